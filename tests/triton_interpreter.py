"""Two costs of Triton's CPU interpreter that the tests need not pay (``TRITON_INTERPRET=1``).

Measured on a two-core machine like CI's with triton 3.9 (``test_cascade_end_to_end_gives_hf_tokens``
run alone: 120 s as installed, 92 s with the first change, 68 s with both; the whole CI script
33 -> 24 minutes):

- Every call of a nested ``@triton.jit`` function inside a kernel patches ``triton.language``
  again: ``inspect.getmembers`` over the language module, its tensor class and ``tl.math``, a
  couple of milliseconds each time, although the launch has already patched every builtin and the
  nested pass finds nothing left to patch. Here each package's builtins are listed once, and a
  call patches only those still unpatched: the same attributes end up patched as before.
- The interpreter checks every int32 add, sub and mul for overflow (its ``sanitize_overflow``
  option: the operands cast to int64, compared with the bounds, an assert), which a compiled
  kernel does only in debug builds; the engine's GPU kernels run without it. Off here, an int32
  index that overflowed would wrap as it does on the GPU, and the test's comparison with its
  reference would see the wrong output.

Both reach into the interpreter's private functions: where a Triton release renames them, the
interpreter is left as it is (slower, never wrong).
"""

from __future__ import annotations

import dataclasses
import inspect


def speed_up_triton_interpreter() -> bool:
    """Install both changes; False (nothing changed) where this Triton lacks what they replace."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    signatures = {"_patch_builtin": ["pkg", "builder", "scope"],
                  "_patch_attr": ["obj", "name", "member", "builder", "scope"]}
    if not (all(_parameters(getattr(interpreter, name, None)) == names for name, names in signatures.items())
            and dataclasses.is_dataclass(options)
            and "sanitize_overflow" in {f.name for f in dataclasses.fields(options)}):
        return False
    packages = (tl, tl.core, tl.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None))
    builtins = {id(pkg): [(name, member) for name, member in inspect.getmembers(pkg)
                          if tl.core.is_builtin(member)] for pkg in packages if pkg is not None}
    patch_builtin = interpreter._patch_builtin

    def patch_unpatched_builtins(pkg, builder_, scope):
        members = builtins.get(id(pkg))
        if members is None:  # a package this list did not foresee: Triton's own pass
            return patch_builtin(pkg, builder_, scope)
        for name, member in members:
            if getattr(pkg, name, None) is member:
                interpreter._patch_attr(pkg, name, member, builder_, scope)

    patch_unpatched_builtins.triton_patch_builtin = patch_builtin  # for tests/test_triton_interpreter.py
    interpreter._patch_builtin = patch_unpatched_builtins
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def _parameters(function) -> list[str] | None:
    return None if function is None else list(inspect.signature(function).parameters)
