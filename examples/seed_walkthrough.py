"""The seed's sections, end to end, written as the seed prints them — on a CPU in a few minutes.

    PYTHONPATH=src python examples/seed_walkthrough.py                # the embedded SmolLM2-135M
    PYTHONPATH=src python examples/seed_walkthrough.py --model DIR --model DIR2 --out walkthrough/

1. check the machine (ECC, clocks, throttling, versions): ``pagedlab.lab.env.env_report()``
2. will it fit (the hardware table): ``pagedlab.lab.plan.plan_memory``
3. load with the seed's arguments: ``LLM(..., chunked_prefill_size=..., trust_remote_code=True)``
4. generate: ``SamplingParams(temperature=0.7, top_p=0.9, seed=1)``
5. benchmark: ``llm.benchmark(batch_size=[4, 8, 16], ..., use_beam_search=False)``, then ``True``
6. ablations: ``for p in ablation_params: llm.set_model_args(**p)``
7. where the time goes: ``llm.start_profile()`` / ``llm.stop_profile()``
8. scaling: each ``--model`` benchmarked (loaded once each), ``sns.lineplot(x="batch_size", y="throughput",
   hue="model_size")`` written to ``scaling.png``

The sizes default to what a CPU runs quickly (the seed's input 512 / output 128 are for a GPU:
``--input-len 512 --output-len 128``). Everything lands in ``--out``. It took 3.5 minutes on a
2-core CPU shared with other jobs (``OMP_NUM_THREADS=1``: on a busy CPU, torch's threads waiting
on each other are slower than one thread).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pagedlab import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Why is the sky blue?", "def fibonacci(n):", "Once upon a time,"]
SEED_TABLE = (("llama3-8b", "RTX-4090"), ("llama3-8b", "A100-80GB"), ("llama3-70b", "A100-80GB"),
              ("llama3-70b", "H200"))


def check_machine() -> None:
    from pagedlab.cli.env_plan import format_env
    from pagedlab.lab.env import env_report

    print(format_env(env_report()))


def will_it_fit() -> None:
    from pagedlab.lab.plan import gpu_memory_bytes, plan_memory, size_class
    from pagedlab.workloads import model_shape

    for shape, gpu in SEED_TABLE:
        plan = plan_memory(model_shape(shape), gpu_memory_bytes(gpu), max_model_len=4096)
        verdict = "fits" if plan.fits else "does NOT fit"
        print(f"{shape} ({size_class(plan.parameters)}) on {gpu}: {verdict}: {plan.summary()}")


def generate(llm: LLM, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=max_tokens)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        print(f"{prompt!r} -> {out.outputs[0].text!r}")


def benchmark(llm: LLM, args, out: Path):
    report = llm.benchmark(batch_size=args.batch_size, input_len=args.input_len, output_len=args.output_len,
                           use_beam_search=False)
    print(report)
    report.save(out / "bench.json")
    beams = llm.benchmark(batch_size=args.batch_size[:1], input_len=args.input_len,
                          output_len=min(args.output_len, 8), use_beam_search=True,
                          beam_width=args.beam_width)
    print(beams)
    return report


def ablations(llm: LLM, args) -> None:
    ablation_params = [{"block_size": 16}, {"block_size": 32}, {"enable_prefix_caching": False},
                       {"max_num_seqs": 2}, {"chunked_prefill_size": 32}]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for p in ablation_params:
        llm.set_model_args(**p)  # re-plans the KV cache and the scheduler, keeps the weights
        start = time.perf_counter()
        results = llm.generate(PROMPTS, params, use_tqdm=False)
        tokens = sum(len(r.outputs[0].token_ids) for r in results)
        print(f"{p}: {tokens / (time.perf_counter() - start):.1f} output tokens/s")


def where_the_time_goes(llm: LLM, args, out: Path) -> None:
    from pagedlab.lab.profile import format_kernel_table, save_profile

    llm.start_profile(str(out / "profile"))
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=args.output_len), use_tqdm=False)
    summary = llm.stop_profile()
    save_profile(summary, out / "profile")
    print(format_kernel_table(summary, per_kind=3))


def scaling(llm: LLM, report, other_models: list[str], args, engine_args: dict, out: Path) -> None:
    """``report``: the loaded model's benchmark (section 5); each other model is benchmarked the same."""
    import pandas as pd
    import seaborn as sns
    from matplotlib.figure import Figure

    from pagedlab.lab.plan import count_parameters, size_class

    def measure(llm: LLM, report=None) -> list[dict]:
        model_size = size_class(count_parameters(llm.get_engine_info().hf_config))
        report = report or llm.benchmark(batch_size=args.batch_size, input_len=args.input_len,
                                         output_len=args.output_len)
        return [{"model_size": model_size, "batch_size": r.batch_size, "throughput": r.output_throughput,
                 "throughput_per_gpu": r.output_throughput_per_gpu} for r in report.runs]

    rows = measure(llm, report)
    for model in other_models:  # each loaded once, in turn
        with LLM(model, **engine_args) as other:
            rows += measure(other)
    df = pd.DataFrame(rows)
    ax = Figure(figsize=(6, 4), layout="constrained").subplots()
    sns.lineplot(data=df, x="batch_size", y="throughput", hue="model_size", marker="o", ax=ax)
    ax.set_ylabel("output tokens/s")
    ax.figure.savefig(out / "scaling.png")
    print(df.to_string(index=False))


def _numbered_sections():
    count = iter(range(1, 100))
    return lambda title: print(f"\n== {next(count)}. {title}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", default=None,
                   help="a model (repeatable: the scaling section benchmarks each; default: the embedded "
                        "smollm2-135m-instruct)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--beam-width", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="seed-walkthrough", help="output directory")
    args = p.parse_args(argv)
    models = args.model or ["smollm2-135m-instruct"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    section = _numbered_sections()
    section("the machine")
    check_machine()
    section("will it fit")
    will_it_fit()
    longest = -(-2 * (args.input_len + args.output_len) // 64) * 64  # room for the prompts, rounded up
    engine_args = dict(device=args.device, enforce_eager=True, trust_remote_code=True, max_model_len=longest,
                       chunked_prefill_size=max(64, args.input_len), kv_cache_memory_bytes=256 << 20)
    with LLM(model=models[0], **engine_args) as llm:
        section(f"loaded {models[0]}: {llm.get_engine_info().resolved_settings()}")
        section("generate")
        generate(llm, args.output_len)
        section("benchmark")
        report = benchmark(llm, args, out)
        section("ablations")
        ablations(llm, args)
        section("where the time goes")
        where_the_time_goes(llm, args, out)
        section("scaling")
        scaling(llm, report, models[1:], args, engine_args, out)
    print(f"\nwrote {out}/bench.json, {out}/profile/ and {out}/scaling.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
