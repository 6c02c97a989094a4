"""One step's scores of prompt rows (row ``i`` predicts prompt token ``i + 1``), from the logits
of the rows ``step_inputs.add_prompt_rows`` marked: vLLM's ``prompt_logprobs`` (each row's next
prompt token and its top N) and ``prompt_logprob_token_ids`` (fixed ids at every row from
``prompt_logprob_start``: ``RequestOutput.prompt_token_id_logprobs``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedlab.engine.request import Request
from pagedlab.engine.step_inputs import HostToDevice
from pagedlab.engine.step_outputs import PromptLogprobsChunk
from pagedlab.layers.batch_invariant import log_softmax
from pagedlab.layers.sampler import TopLogprobs, gather_logprobs

ToHost = Callable[[torch.Tensor], torch.Tensor]


def top_to_host(top: TopLogprobs, to_host: ToHost) -> TopLogprobs:
    """``top`` with each of its tensors copied to the host by ``to_host``."""
    return TopLogprobs(*(to_host(t) if t is not None else None for t in (
        top.token_logprob, top.token_rank, top.top_ids, top.top_logprobs, top.label_logprobs,
        top.label_ranks)))


def score_prompt_rows(logits: torch.Tensor, requests: list[Request], chunks: dict[str, tuple[int, int, int]],
                      to_device: HostToDevice, to_host: ToHost) -> dict[str, PromptLogprobsChunk]:
    """Each request's scores of its rows in the step. ``logits``: the step's prompt rows in order;
    ``chunks``: ``StepInputs.prompt_chunks`` (request id -> its first row in ``logits``, row count,
    prompt position of that row); ``to_host`` copies a device tensor to the host."""
    by_id = {r.request_id: r for r in requests}
    result = {}
    for request_id, (first, count, position) in chunks.items():
        params = by_id[request_id].sampling_params
        logprobs = log_softmax(logits[first:first + count])
        targets = by_id[request_id].prompt_token_ids[position + 1:position + 1 + count]
        chunk = result[request_id] = PromptLogprobsChunk(position + 1, targets, None)
        if params.prompt_logprobs is not None:
            top = gather_logprobs(logprobs, to_device(targets, torch.int64), params.prompt_logprobs)
            chunk.logprobs = top_to_host(top, to_host)
        if params.prompt_logprob_token_ids is not None:
            start = params.prompt_logprob_start or 0
            skip = max(start - position, 0)  # rows before the start, scored for prompt_logprobs only
            if skip < count:
                ids = to_device(params.prompt_logprob_token_ids, torch.int64)
                chunk.token_id_logprobs = to_host(logprobs[skip:].index_select(1, ids))
                chunk.token_id_row = position + skip - start
    return result
