"""A step's host inputs on their way to the device: ``PinnedStaging``'s deferred block (one copy
for many arrays), its growth and alternation, and ``HostToDevice``'s CPU stand-in, which poisons a
deferred tensor until its block ends (as a CUDA kernel queued inside the block would read it
before its copy). The CUDA path runs the same offsets with pinned buffers (tests/test_gpu.py's
HF parity)."""

import numpy as np
import pytest
import torch

from pagedlab.engine.step_inputs import HostToDevice, PinnedStaging, StepInputs, stage_forward_inputs

CPU = torch.device("cpu")
ARRAYS = [([3, 1, 4, 1, 5], torch.int64), ([[9, 2], [6, 5]], torch.int32), ([0.5, -2.25], torch.float32),
          ([True, False, True], torch.bool)]


def _expected(values, dtype):
    return torch.as_tensor(np.asarray(values), dtype=dtype)


def _stage_all(staging, arrays=ARRAYS):
    return [staging.to_device(values, dtype) for values, dtype in arrays]


def test_a_deferred_block_is_one_copy_and_every_view_holds_its_array(monkeypatch):
    staging = PinnedStaging(CPU, nbytes=4096)
    staging.begin_step()
    for mirror in staging._mirrors:
        mirror.fill_(0xAB)
    copies = []
    original = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, **kw: copies.append(src.numel()) or
                        original(self, src, **kw))
    with staging.deferred():
        tensors = _stage_all(staging)
        assert all(not torch.equal(t, _expected(v, d)) for t, (v, d) in zip(tensors, ARRAYS))
    assert len(copies) == 1
    for tensor, (values, dtype) in zip(tensors, ARRAYS):
        assert tensor.dtype == dtype and torch.equal(tensor, _expected(values, dtype))


def test_outside_a_block_each_array_is_its_own_copy():
    staging = PinnedStaging(CPU, nbytes=4096)
    staging.begin_step()
    first = staging.to_device([1, 2, 3], torch.int64)
    second = staging.to_device([4, 5], torch.int64)
    staging.begin_step()
    staging.begin_step()  # the first buffer again: its bytes are rewritten
    staging.to_device([7, 7, 7], torch.int64)
    assert first.tolist() == [1, 2, 3] and second.tolist() == [4, 5]


def test_a_step_keeps_its_views_while_the_next_step_stages_into_the_other_buffer():
    staging = PinnedStaging(CPU, nbytes=4096)
    staging.begin_step()
    with staging.deferred():
        kept = staging.to_device([10, 20, 30], torch.int64)
    staging.begin_step()
    with staging.deferred():
        other = staging.to_device([40, 50, 60], torch.int64)
    assert kept.tolist() == [10, 20, 30] and other.tolist() == [40, 50, 60]


@pytest.mark.parametrize("nbytes", [64, 256])
def test_outgrowing_the_buffer_inside_a_block_keeps_every_array(nbytes):
    staging = PinnedStaging(CPU, nbytes=nbytes)
    staging.begin_step()
    arrays = ARRAYS + [(list(range(100)), torch.int64)] + ARRAYS
    with staging.deferred():
        tensors = _stage_all(staging, arrays)
    for tensor, (values, dtype) in zip(tensors, arrays):
        assert torch.equal(tensor, _expected(values, dtype))
    # later steps: a buffer grown past its mirror stages what fits there and copies the rest at once
    for _ in range(3):
        staging.begin_step()
        with staging.deferred():
            tensors = _stage_all(staging, arrays)
        for tensor, (values, dtype) in zip(tensors, arrays):
            assert torch.equal(tensor, _expected(values, dtype))


def test_the_cpu_stand_in_poisons_a_deferred_tensor_until_its_block_ends():
    to_device = HostToDevice(CPU)
    with to_device.deferred():
        ids = to_device([5, 6], torch.int64)
        scale = to_device([0.5], torch.float32)
        assert ids.tolist() != [5, 6] and torch.isnan(scale).all()
    assert ids.tolist() == [5, 6] and scale.tolist() == [0.5]
    assert to_device([1], torch.int32).tolist() == [1]  # outside a block: at once


def test_forward_inputs_staged_and_the_lm_head_rows_sliced_when_they_lead_in_order():
    inputs = StepInputs(input_ids=[11, 12, 13], positions=[4, 9, 2], slots=[40, 91, 22], seq_lens=[5, 10, 3],
                        pending_rows=[1], pending_sources=[0], sample_rows=[0, 1, 2])
    table = np.array([[2, 3, 0], [4, 5, 6], [7, 0, 0]], dtype=np.int32)
    staged = stage_forward_inputs(inputs, table, HostToDevice(CPU))
    assert staged.input_ids.tolist() == [11, 12, 13] and staged.positions.tolist() == [4, 9, 2]
    assert staged.slot_mapping.tolist() == [40, 91, 22] and staged.seq_lens.dtype == torch.int32
    assert staged.block_tables.tolist() == table.tolist() and staged.seq_lens.tolist() == [5, 10, 3]
    assert staged.pending_rows.tolist() == [1] and staged.pending_sources.tolist() == [0]
    assert staged.logit_rows is None
    inputs.sample_rows, inputs.prompt_rows = [2], [0, 1]
    staged = stage_forward_inputs(inputs, table, HostToDevice(CPU))
    assert staged.logit_rows.tolist() == [2, 0, 1]
    inputs.pending_rows, inputs.pending_sources = [], []
    staged = stage_forward_inputs(inputs, table, HostToDevice(CPU))
    assert staged.pending_rows is None and staged.input_ids.tolist() == [11, 12, 13]
    # every id the previous step's, in its order: that tensor is read, nothing staged for the ids
    inputs.pending_rows, inputs.pending_sources = [0, 1, 2], [0, 1, 2]
    staged = stage_forward_inputs(inputs, table, HostToDevice(CPU))
    assert staged.input_ids is None and staged.pending_rows is None and staged.num_tokens == 3
    inputs.pending_sources = [0, 2, 1]  # reordered: scattered
    staged = stage_forward_inputs(inputs, table, HostToDevice(CPU))
    assert staged.pending_sources.tolist() == [0, 2, 1] and staged.input_ids is not None
