"""One vocabulary (issue 22, item 5): every setting the planner emits is a field of the role's
service settings with the same name, its value validates there (read back from the very
environment lines `--emit env` prints), and a multi-card plan shards only when it says so."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.plan import vocabulary
from services.plan.catalog import Catalog, parse_card_spec
from services.plan.cli import main
from services.plan.memory import Method, TrainerKnobs, Workload, trainer_memory
from services.plan.model_shape import resolve_shape
from services.plan.placement import candidates
from services.ref.settings import RefSettings
from services.rollout.settings import RolloutSettings
from services.trainer.quant import check_savers
from services.trainer.settings import TrainerSettings

SETTINGS = {"trainer": TrainerSettings, "rollout": RolloutSettings, "ref": RefSettings}
W = Workload(prompt_len=512, completion_len=1024, group_size=8, batch=32)
CARD_SETS = [["h200"], ["h100:2"], ["rtx4070", "mi50-32:2"], ["h200", "mi50-32:3"], ["h800:2"]]


def build(role: str, settings: dict[str, Any], mp: pytest.MonkeyPatch) -> Any:
    """The role's settings built as at start-up: from the environment lines the planner prints."""
    for name, value in vocabulary.env_vars(role, settings).items():
        mp.setenv(name, vocabulary.env_value(value))
    if role != "trainer":
        mp.setenv(f"BURSTRL_{role.upper()}_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    return SETTINGS[role]()


@pytest.mark.parametrize("model", ["Qwen2.5-0.5B", "Qwen2.5-7B"])
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_every_emitted_key_is_a_service_setting_that_validates(
    model: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in [v for v in __import__("os").environ if v.startswith("BURSTRL_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("BURSTRL_DEV", "1")
    cat, shape, method = Catalog(), resolve_shape(model), Method(kind=kind)  # type: ignore[arg-type]
    seen: dict[str, set[str]] = {role: set() for role in SETTINGS}
    placements, shardings = set(), set()
    for specs in CARD_SETS:
        cards = [parse_card_spec(s, cat) for s in specs]
        for layout in candidates(shape, method, W, cards):
            placements.add(layout.placement)
            for r in layout.roles + ([layout.replica] if layout.replica else []):
                for settings in (r.recommended, r.min_settings):
                    unknown = set(settings) - set(SETTINGS[r.role].model_fields)
                    assert not unknown, f"{r.role} on {r.count}x {r.card}: {unknown} are not {r.role} settings"
                    with monkeypatch.context() as mp:
                        built = build(r.role, settings, mp)
                    assert {k: getattr(built, k) for k in settings} == settings, f"{r.role}: {settings}"
                    seen[r.role] |= set(settings)
                    if r.role == "trainer":
                        shardings.add(settings["sharding"])
    assert placements == {"colocated", "disaggregated"} and shardings == {"ddp", "fsdp"}
    assert {"gradient_checkpointing", "micro_batch_tokens", "logits_chunk", "optimizer"} <= seen["trainer"]
    assert {"base_bits", "cpu_offload", "sharding", "dtype"} <= seen["trainer"]
    assert set(vocabulary.ENGINE_KEYS) <= seen["rollout"]
    assert {"max_batch_tokens", "logits_chunk"} <= seen["ref"]


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_every_trainer_plan_combines_only_savers_the_trainer_accepts(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44, item 8: the leanest rung stacked every saver, so a k-card LoRA plan's min settings
    said sharding=fsdp with base_bits=4 and a full fine-tune's said cpu_offload with adamw8bit:
    pairs the trainer refuses at start-up (services/trainer/quant.check_savers)."""
    for var in [v for v in __import__("os").environ if v.startswith("BURSTRL_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("BURSTRL_DEV", "1")
    cat, method = Catalog(), Method(kind=kind)  # type: ignore[arg-type]
    sharded = 0
    for model in ["Qwen2.5-0.5B", "Qwen2.5-7B", "Qwen2.5-32B"]:
        for specs in [*CARD_SETS, ["h100:4"], ["rtx4070:2"]]:
            cards = [parse_card_spec(s, cat) for s in specs]
            for layout in candidates(resolve_shape(model), method, W, cards):
                for settings in (layout.roles[0].recommended, layout.roles[0].min_settings):
                    with monkeypatch.context() as mp:
                        built = build("trainer", settings, mp)
                    if built.sharding == "fsdp" or built.cpu_offload:
                        sharded += 1
                        check_savers(built, "cpu")  # bitsandbytes' savers are off here: no probe runs
    assert sharded > 0


def test_emit_env_prints_each_roles_environment(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "Qwen2.5-1.5B", "--cards", "h200", "mi50-32:3", "--emit", "env"]) == 0
    text = capsys.readouterr().out
    headers = [line for line in text.splitlines() if line.startswith("# [env.")]
    assert [h.split("]")[0] for h in headers] == ["# [env.trainer", "# [env.rollout", "# [env.ref"]
    names = {line.split("=", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}
    known = {f"{cls.model_config['env_prefix']}{f}".upper() for cls in SETTINGS.values() for f in cls.model_fields}
    assert names and names <= known, names - known
    assert "BURSTRL_TRAINER_GRADIENT_CHECKPOINTING=false" in text and "BURSTRL_TRAINER_SHARDING=ddp" in text
    # The MI50s run the gfx906 fork's server: rollout is its client; the engine's sizes are serve flags.
    assert "BURSTRL_ROLLOUT_ENGINE=remote" in text and "vllm serve --gpu-memory-utilization=" in text
    assert "BURSTRL_ROLLOUT_GPU_MEMORY_UTILIZATION" not in text
    assert main(["--model", "Qwen2.5-1.5B", "--cards", "h200", "--emit", "env", "--profile", "min"]) == 0
    lean = capsys.readouterr().out
    assert "BURSTRL_TRAINER_GRADIENT_CHECKPOINTING=true" in lean and "BURSTRL_ROLLOUT_GPU_MEMORY_UTILIZATION=" in lean


def _trainer(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["roles"][0]


def test_multi_card_full_fine_tune_shards_only_when_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 22: `--method full --cards h800:2 --placement colocated` on a 14B model reported a
    per-card peak that holds only with FSDP, while the trainer it described was DDP. Now the
    peak is the one of the sharding the plan names."""
    base = ["--method", "full", "--placement", "colocated", "--objective", "time"]
    for model, cards, sharding in [("Qwen2.5-14B", "h800:2", "fsdp"), ("Qwen2.5-0.5B", "h100:2", "ddp")]:
        t = _trainer(["--model", model, "--cards", cards, *base], capsys)
        assert t["count"] == 2 and t["recommended"]["sharding"] == sharding, (model, t["recommended"])
        rec = t["recommended"]
        knobs = TrainerKnobs(
            dtype="bf16",
            micro_batch=rec["micro_batch_tokens"] // W.seq_len,
            gradient_checkpointing=rec["gradient_checkpointing"],
            logits_chunk=rec["logits_chunk"] or None,
            optimizer=rec["optimizer"],
            cpu_offload=rec["cpu_offload"],
            fsdp_shards=2 if sharding == "fsdp" else 1,  # DDP: every card holds the whole model
        )
        peak = trainer_memory(resolve_shape(model), Method(kind="full"), W, knobs).peak_bytes / 1e9
        assert t["peak_gb"] == pytest.approx(peak, rel=1e-6)
        assert t["layout"]["processes"] == 2 and "torchrun --nproc-per-node=2" in t["layout"]["launcher"]
