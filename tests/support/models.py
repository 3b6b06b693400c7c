"""The tiny models the tests use, and where each lives.

They ship in the package (shared/ml/weights/, shared/ml/models.py): a fixture copies one into
.burstrl/models/ in well under a second, so no test builds a model, and every machine runs the
tests on the same bytes. BURSTRL_TEST_MODEL points the tiny model's fixture at another folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.support import ROOT

MODELS = ROOT / ".burstrl" / "models"
TINY = Path(os.environ.get("BURSTRL_TEST_MODEL", MODELS / "tiny-sft"))
CALC = MODELS / "tiny-calc"
TEACHER = MODELS / "tiny-teacher"

# fixture name -> (model name, its folder)
FIXTURES = {
    "tiny_model": ("tiny-sft", TINY),
    "calc_model": ("tiny-calc", CALC),
    "teacher_model": ("tiny-teacher", TEACHER),
}


def build(fixture: str) -> Path:
    """The model behind fixture `fixture`, in its folder (copied from the shipped bytes)."""
    from shared.ml.models import ensure_model

    if fixture not in FIXTURES:
        raise ValueError(f"no test model for fixture {fixture!r}; known: {', '.join(FIXTURES)}")
    name, folder = FIXTURES[fixture]
    if fixture == "tiny_model" and "BURSTRL_TEST_MODEL" in os.environ:
        return folder.resolve()  # the caller's own model, used as it is
    return ensure_model(name, folder, log=lambda _: None)
