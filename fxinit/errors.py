"""The one exception type fxinit raises for things it cannot defer or replay."""

from __future__ import annotations


class DeferredInitError(RuntimeError):
    """Raised when construction or initialization cannot be deferred exactly.

    fxinit never returns a tensor it is not sure about: anything that would need the
    value of a deferred tensor during capture (``.item()``, ``if t.any():``,
    ``nonzero``...), an operator with no meta implementation, raw storage access, or a
    materialization that cannot be reproduced raises this error. The message names the
    operation, the module path and the user's source line, and says what to do.
    """

    def __init__(
        self,
        what: str,
        *,
        op: str | None = None,
        module: str | None = None,
        source: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.op = op
        self.module = module
        self.source = source
        self.hint = hint
        parts = [what]
        if op:
            parts.append(f"  op:     {op}")
        if module:
            parts.append(f"  module: {module}")
        if source:
            parts.append(f"  source: {source}")
        if hint:
            parts.append(f"  hint:   {hint}")
        super().__init__("\n".join(parts))


class ArtifactError(DeferredInitError):
    """A saved init graph that fxinit refuses to load: damaged, from a newer schema,
    naming an op outside the allowed set, or inconsistent with itself."""


class ExportError(DeferredInitError):
    """A checkpoint export that could not be written: a full disk, a directory that cannot
    be written, or one holding a different export. Files written under their final name
    are complete; nothing else is left that looks complete."""
