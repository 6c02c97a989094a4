"""vLLM's ``hf_overrides``: changes to the served model's Hugging Face config before the model is built.

``EngineConfig.hf_overrides`` is a dict or a callable, as vLLM's ``ModelConfig.hf_overrides``:

- a dict's entries whose value is not a dict are set on the config (``PretrainedConfig.update``);
  then each entry whose value is a dict is merged, key by key and recursively, into the sub-config
  of that name where the config has one (``{"text_config": {"num_hidden_layers": 2}}``), and
  replaces the attribute whole where it has none (``{"rope_scaling": {...}}``);
- a callable gets the config read from config.json and returns the config to use.

A key the config does not have is set anyway, as vLLM sets it (a model may read it), with a
warning naming the closest known key. Where the overrides change the RoPE parameters, a
``rope_scaling``/``rope_parameters`` dict that leaves out ``rope_theta`` or
``partial_rotary_factor`` keeps the checkpoint's (pagedlab's addition: vLLM would drop them), and
the parameters are completed and checked as transformers completes a config.json's
(``standardize_rope_params``, ``validate_rope``). The tokenizer and the generation config are
read as they are, as in vLLM. ``pagedlab.loader.hf_config.load_hf_config`` reads a model's config
with its overrides applied.
"""

from __future__ import annotations

import copy
import logging

from pagedlab.names import did_you_mean

logger = logging.getLogger(__name__)

_MODEL_PROPERTIES = ("rope_theta", "partial_rotary_factor")  # of the model, not of its RoPE scaling


def check_hf_overrides(value) -> None:
    """A ValueError unless ``value`` is None, a callable or a dict whose keys are strings (the
    config's attribute names; nested dicts likewise)."""
    if value is None or callable(value):
        return
    if not isinstance(value, dict):
        raise ValueError(f"hf_overrides={value!r} is invalid: hf_overrides must be a dict of config "
                         "attributes (e.g. {\"num_hidden_layers\": 4}), a callable taking and returning "
                         "the PretrainedConfig, or None")
    bad = _non_string_key(value)
    if bad is not None:
        raise ValueError(f"hf_overrides={value!r} is invalid: its key {bad!r} is not a string (keys name "
                         "config attributes)")


def _non_string_key(d: dict):
    for key, value in d.items():
        if not isinstance(key, str):
            return key
        if isinstance(value, dict) and (bad := _non_string_key(value)) is not None:
            return bad
    return None


def describe_hf_overrides(value):
    """``value`` as plain data for settings and manifests: a dict as given, a callable by its
    qualified name (``"callable:module.name"``: its code is not recorded), None as None."""
    if callable(value):
        name = getattr(value, "__qualname__", None) or type(value).__qualname__
        return f"callable:{getattr(value, '__module__', None) or '?'}.{name}"
    return copy.deepcopy(value)


def apply_hf_overrides(hf_config, overrides):
    """``hf_config`` (a transformers ``PretrainedConfig``) with ``overrides`` applied (see the
    module's docstring); a callable's result must be a ``PretrainedConfig``."""
    from transformers import PretrainedConfig

    if overrides is None:
        return hf_config
    check_hf_overrides(overrides)
    rope_before = copy.deepcopy(getattr(hf_config, "rope_parameters", None))
    if callable(overrides):
        hf_config = overrides(hf_config)
        if not isinstance(hf_config, PretrainedConfig):
            raise ValueError(f"hf_overrides={describe_hf_overrides(overrides)!r} returned "
                             f"{type(hf_config).__name__}: it must return the PretrainedConfig it is given "
                             "(changed) or another PretrainedConfig")
    else:
        _apply_dict(hf_config, overrides)
    if getattr(hf_config, "rope_parameters", None) != rope_before:
        _complete_rope(hf_config, rope_before, overrides)
    return hf_config


def _apply_dict(hf_config, overrides: dict) -> None:
    """Flat values first, then nested dicts merged into sub-configs (vLLM's order)."""
    from transformers import PretrainedConfig

    unknown = [key for key in overrides if not hasattr(hf_config, key)]
    for key in unknown:
        hint = did_you_mean(key, hf_config.to_dict())
        logger.warning("hf_overrides sets %r, which %s does not have%s: set anyway, as vLLM does",
                       key, type(hf_config).__name__, hint)
    hf_config.update(copy.deepcopy({k: v for k, v in overrides.items() if not isinstance(v, dict)}))
    for key, value in overrides.items():
        if not isinstance(value, dict):
            continue
        current = getattr(hf_config, key, None)
        if isinstance(current, PretrainedConfig):
            _merge(current, value)
        else:
            setattr(hf_config, key, copy.deepcopy(value))


def _merge(target, updates: dict) -> None:
    """``updates`` into a sub-config or dict, recursing where both sides hold a dict or a config."""
    for key, value in updates.items():
        current = target.get(key) if isinstance(target, dict) else getattr(target, key, None)
        if isinstance(value, dict) and (isinstance(current, dict) or hasattr(current, "__dict__")):
            _merge(current, value)
        elif isinstance(target, dict):
            target[key] = copy.deepcopy(value)
        else:
            setattr(target, key, copy.deepcopy(value))


def _complete_rope(hf_config, before, overrides) -> None:
    """Changed RoPE parameters keep the model's ``rope_theta`` / ``partial_rotary_factor`` where a
    one-dict override leaves them out, then are completed and checked as transformers does."""
    params = getattr(hf_config, "rope_parameters", None)
    flat = isinstance(params, dict) and not any(isinstance(v, dict) for v in params.values())
    if flat and isinstance(before, dict) and not any(isinstance(v, dict) for v in before.values()):
        for key in _MODEL_PROPERTIES:
            if params.get(key) is None and before.get(key) is not None:
                params[key] = before[key]
    if not hasattr(hf_config, "validate_rope"):  # transformers < 5 keeps no rope_parameters
        return
    try:
        hf_config.standardize_rope_params()
        hf_config.validate_rope()
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"hf_overrides={describe_hf_overrides(overrides)!r} is invalid: its RoPE parameters "
                         f"{getattr(hf_config, 'rope_parameters', None)!r} fail transformers' check: "
                         f"{e}") from None
