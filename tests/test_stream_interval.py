"""vLLM's stream interval: the engine's ``stream_interval`` (``--stream-interval``) and a request's
``SamplingParams.stream_interval`` (clamped up to the engine's) batch new tokens into streamed
outputs. The first token goes out at once, then every k-th, and the final output at the finish;
the outputs still add up to the non-streamed result token for token (text, ids, logprobs), through
``LLMEngine.step``, ``AsyncEngine`` and the server, in DELTA and CUMULATIVE kinds and with n > 1."""

from __future__ import annotations

import argparse
import asyncio

import numpy as np
import pytest

from pagedlab import LLM, SamplingParams
from pagedlab.cli.engine_args import add_engine_args, engine_config_from_args
from pagedlab.config import EngineConfig
from pagedlab.engine.async_engine import AsyncEngine
from pagedlab.sampling_params import RequestOutputKind
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

PROMPT = "Why is the sky blue?"
N = 11  # output tokens: with k = 3 the outputs hold 1, 4, 7, 10 and (the final) 11
BASE = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, logprobs=2)
DELTA, CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE


def boundaries(k: int, total: int = N) -> list[int]:
    """The output token counts a stream interval of k gives: 1, 1 + k, 1 + 2k, ... and the final."""
    return sorted(set(range(1, total, k)) | {total})


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with LLM(build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat")),
             kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm):
    """The non-streamed results: one completion, and two seeded ones."""
    one = llm.generate(PROMPT, BASE, use_tqdm=False)[0].outputs[0]
    two = llm.generate(PROMPT, BASE.clone(n=2, temperature=1.0, seed=5), use_tqdm=False)[0].outputs
    return one, two


def stepped(llm, params: SamplingParams) -> list:
    """Every output ``LLMEngine.step`` returns for one request."""
    engine, outs = llm.llm_engine, []
    engine.add_request("r", PROMPT, params)
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def joined(outs, kind: RequestOutputKind, index: int = 0):
    """(text, token ids, logprobs) of completion ``index`` the outputs add up to."""
    completions = [next(c for c in out.outputs if c.index == index) for out in outs]
    if kind == CUMULATIVE:
        last = completions[-1]
        return last.text, last.token_ids, last.logprobs
    return ("".join(c.text for c in completions), [t for c in completions for t in c.token_ids],
            [p for c in completions for p in c.logprobs])


def counts(outs, kind: RequestOutputKind, index: int = 0) -> list[int]:
    """Completion ``index``'s output tokens after each output."""
    sizes = [len(next(c for c in out.outputs if c.index == index).token_ids) for out in outs]
    return sizes if kind == CUMULATIVE else list(np.cumsum(sizes))


def test_bad_values_name_the_field():
    for bad in (0, -2, 2.5, True, "3"):
        with pytest.raises(ValueError, match=rf"stream_interval={bad!r} is invalid: stream_interval must be "
                                             r"None or an integer >= 1"):
            SamplingParams(stream_interval=bad)
    assert SamplingParams(stream_interval=np.int64(3)).stream_interval == 3
    for bad, says in ((0, "an integer >= 1"), (2.0, "an integer")):
        with pytest.raises(ValueError, match=rf"stream_interval={bad!r} is invalid: stream_interval must be "
                                             rf"{says}"):
            EngineConfig(stream_interval=bad).validate()


def test_the_cli_flag_sets_the_engine_setting():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--stream-interval", "4"])).stream_interval == 4
    assert engine_config_from_args(parser.parse_args([])).stream_interval == 1


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE], ids=["delta", "cumulative"])
@pytest.mark.parametrize("engine_k, request_k, k", [
    (1, None, 1), (1, 3, 3), (1, 50, 50),  # 50: larger than the output, so only the first and the final
    (3, None, 3), (3, 2, 3), (3, 5, 5),  # vLLM's clamp: a request raises the engine's interval, not lowers
])
def test_engine_steps_batch_tokens_and_add_up(llm, reference, kind, engine_k, request_k, k):
    llm.set_model_args(stream_interval=engine_k)
    try:
        outs = stepped(llm, BASE.clone(output_kind=kind, stream_interval=request_k))
    finally:
        llm.set_model_args(stream_interval=1)
    assert counts(outs, kind) == boundaries(k)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    want = reference[0]
    assert joined(outs, kind) == (want.text, want.token_ids, want.logprobs)


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE], ids=["delta", "cumulative"])
def test_each_of_n_completions_batches_and_adds_up(llm, reference, kind):
    params = BASE.clone(n=2, temperature=1.0, seed=5, output_kind=kind, stream_interval=3)
    outs = stepped(llm, params)
    for index, want in enumerate(reference[1]):
        assert counts(outs, kind, index) == boundaries(3)
        assert joined(outs, kind, index) == (want.text, want.token_ids, want.logprobs)


def test_the_offline_llm_returns_whole_final_outputs(llm, reference):
    out = llm.generate(PROMPT, BASE.clone(output_kind=DELTA, stream_interval=4), use_tqdm=False)[0]
    assert out.finished and out.outputs[0].token_ids == reference[0].token_ids


async def _emitted(engine: AsyncEngine, params: SamplingParams) -> list:
    """Every output the engine thread puts in the request's stream, read raw off its queue (iterating
    the stream would merge outputs a slow reader left waiting, which is timing, not the interval)."""
    stream, outs = engine.add_request(PROMPT, params), []
    queue = stream._stream.queue
    while not (outs and outs[-1].finished):
        outs.append(await queue.get())
    return outs


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE], ids=["delta", "cumulative"])
@pytest.mark.parametrize("request_k, k", [(None, 2), (1, 2), (3, 3), (40, 40)])
def test_async_engine_streams_batched_outputs(llm, reference, kind, request_k, k):
    """An engine-level interval of 2 under AsyncEngine: the outputs it emits, and what a reader of
    the stream gets (perhaps merged, always adding up)."""
    llm.set_model_args(stream_interval=2)
    engine = AsyncEngine.from_llm(llm)

    async def main():
        params = BASE.clone(output_kind=kind, stream_interval=request_k)
        read = [out async for out in engine.generate(PROMPT, params)]
        return await _emitted(engine, params), read

    try:
        emitted, read = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.shutdown()
        llm.set_model_args(stream_interval=1)
    assert counts(emitted, kind) == boundaries(k)
    want = reference[0]
    assert set(counts(read, kind)) <= set(boundaries(k)) and read[-1].finished
    for outs in (emitted, read):
        assert joined(outs, kind) == (want.text, want.token_ids, want.logprobs)
