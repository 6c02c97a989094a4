"""The test harness's faster interpreter patching (tests/triton_interpreter.py) patches exactly the
attributes Triton's own pass patches, and nothing again inside a launch's patches."""

from __future__ import annotations

import pytest


def _patched_names(patch, pkg, interpreter) -> tuple[set[str], object]:
    scope = interpreter._LangPatchScope()
    patch(pkg, interpreter.interpreter_builder, scope)
    return {name for _, name, _ in scope._changes}, scope


def test_faster_patching_patches_what_triton_patches():
    pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime import interpreter

    ours = interpreter._patch_builtin
    theirs = getattr(ours, "triton_patch_builtin", None)
    if theirs is None or not hasattr(interpreter, "_LangPatchScope"):
        pytest.skip("the faster patching is not installed with this Triton (TRITON_INTERPRET unset, or a "
                    "release it does not know)")
    for pkg in (tl, tl.core, tl.tensor, tl.math):
        expected, scope = _patched_names(theirs, pkg, interpreter)
        scope.restore()
        got, scope = _patched_names(ours, pkg, interpreter)
        nested = [_patched_names(patch, pkg, interpreter) for patch in (ours, theirs)]  # all patched already
        for _, nested_scope in reversed(nested):
            nested_scope.restore()
        scope.restore()
        assert got == expected and got, pkg
        assert [names for names, _ in nested] == [set(), set()]
