"""Speculative decoding's promise: the same outputs as plain decoding, only sooner."""

from __future__ import annotations

from collections.abc import Sequence

from pagedlab.lab.repro.common import DEFAULT_PROMPTS, CheckResult, NoProgress, encode_all, verdict
from pagedlab.lab.repro.compare import first_divergence
from pagedlab.sampling_params import SamplingParams

DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                              "prompt_lookup_min": 1}


def speculation_parity(llm, speculative_config: dict | None = None, prompts: Sequence = DEFAULT_PROMPTS,
                       max_tokens: int = 32, seeds: Sequence[int] = (0, 1, 2), temperature: float = 0.8,
                       progress=None) -> CheckResult:
    """The same engine decoding plainly and with ``speculative_config`` (default
    ``DEFAULT_SPECULATIVE_CONFIG``; ``set_model_args``, no reload): greedy tokens, and tokens sampled
    at ``temperature`` under each of ``seeds``, must be equal (pagedlab samples each position with
    noise keyed by its seed and position, so speculation changes no token in exact arithmetic; in
    bf16 on a GPU a verification step's kernels round differently from a decode step's, which can
    flip a near-tie). Also the proposals verified and their acceptance; where none was made (too few
    tokens, nothing for the proposer to match) the summary says nothing was tested. The engine's
    plan is restored."""
    config = speculative_config or DEFAULT_SPECULATIVE_CONFIG
    ids = [{"prompt_token_ids": p} for p in encode_all(llm, prompts)]
    runs = {"greedy": SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)}
    runs.update({f"seed {s}": SamplingParams(temperature=temperature, seed=s, max_tokens=max_tokens,
                                             ignore_eos=True) for s in seeds})
    original = llm.get_engine_info().config.speculative_config
    progress = progress if progress is not None else NoProgress()
    progress.reset(total=2 * len(runs))
    tokens: dict[str, dict[str, list]] = {"plain": {}, "speculative": {}}
    try:
        for mode, value in (("plain", None), ("speculative", config)):
            llm.set_model_args(speculative_config=value)
            for name, params in runs.items():
                outs = llm.generate(ids, params, use_tqdm=False)
                tokens[mode][name] = [o.outputs[0].token_ids for o in outs]
                progress.update()
        stats = llm.get_stats()
    finally:
        llm.set_model_args(speculative_config=original)
    return _result(tokens, stats, config, max_tokens, temperature, list(seeds))


def _result(tokens: dict, stats, config: dict, max_tokens: int, temperature: float,
            seeds: list) -> CheckResult:
    plain, speculative = tokens["plain"], tokens["speculative"]
    firsts = {name: [first_divergence(a, b) for a, b in zip(plain[name], speculative[name])]
              for name in plain}
    rates = {name: sum(f is None for f in fs) / len(fs) for name, fs in firsts.items()}
    sampled = [rate for name, rate in rates.items() if name != "greedy"]
    diverged = [f for fs in firsts.values() for f in fs if f is not None]
    metrics = {"num_prompts": len(firsts["greedy"]), "greedy_match_rate": rates["greedy"],
               "sampled_match_rate": sum(sampled) / len(sampled) if sampled else 1.0,
               "first_divergence": min(diverged, default=None),
               "num_drafts": stats.spec_decode_num_drafts,
               "acceptance_rate": stats.spec_decode_acceptance_rate,
               "mean_acceptance_length": stats.spec_decode_mean_acceptance_length}
    summary = (f"speculative tokens equal plain decoding's for {rates['greedy']:.0%} of greedy and "
               f"{metrics['sampled_match_rate']:.0%} of seeded sampled outputs; "
               f"{stats.spec_decode_acceptance_rate:.0%} of proposed tokens accepted")
    if not stats.spec_decode_num_drafts:
        summary += (" (nothing was proposed, so no step was verified and speculation was not tested: give "
                    "more tokens or prompts whose text repeats)")
    params = {"speculative_config": config, "max_tokens": max_tokens, "temperature": temperature,
              "seeds": seeds}
    details = {"tokens": tokens, "match_rates": rates}
    return CheckResult("spec", verdict(bool(diverged)), summary, metrics, details, params)
