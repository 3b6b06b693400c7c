"""The `algorithm` block of a job: the trainer's GRPO-family choices (advantage, loss,
sampler/trainer mismatch correction, aggregation, schedule), validated at the api's door.
Each option and its names in verl / TRL / prime-rl: docs/losses.md."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from shared.limits import SpecModel

# Option fields and the `algorithm` choice each belongs to: setting one to anything but its
# default while another choice is selected is a 422 (it would be silently ignored).
_OPTION_OF = {
    "cispo_min": ("loss", "cispo"),
    "cispo_max": ("loss", "cispo"),
    "sapo_tau_pos": ("loss", "sapo"),
    "sapo_tau_neg": ("loss", "sapo"),
    "dppo_low": ("loss", "dppo_tv"),
    "dppo_high": ("loss", "dppo_tv"),
    "icepop_low": ("mismatch", "icepop"),
    "icepop_high": ("mismatch", "icepop"),
    "geo_low": ("mismatch", "geo_mask"),
    "geo_high": ("mismatch", "geo_mask"),
    "m2po_tau": ("mismatch", "m2po"),
}


class AlgorithmSpec(SpecModel):
    """The trainer's algorithm choices. Defaults reproduce the original GRPO recipe.

    The top-level kl_coef / clip_low / clip_high / tis_cap fields of JobSpec stay where
    they are (other stages and the demo read them); this block adds what varies between
    GRPO-family papers. Each option's names in verl, TRL, prime-rl and SkyRL: docs/losses.md.
    Fields are validated in order, so a cross-field rule sits on the later field and its 422
    names that field. Floats must be finite (SpecModel).
    """

    advantage: Literal["grpo", "dr_grpo", "rloo", "distill", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = (
        Field(
            "grpo",
            description="grpo: (r - group mean) / group std; dr_grpo: r - group mean; rloo: leave-one-out baseline; "
            "distill: per-token teacher-minus-sampler log-prob (the ref model is the teacher); "
            "reinforce_plus_plus: r whitened over the batch's tokens (REINFORCE++); reinforce_plus_plus_baseline: "
            "the group mean subtracted first, then whitened over the batch.",
        )
    )
    advantage_level: Literal["episode", "turn"] = Field(
        "episode",
        description="episode: one advantage per completion, from its reward; turn (multi-turn jobs, with grpo, "
        "dr_grpo or rloo): each model turn's tokens get the advantage of its return-to-go (its own and later turns' "
        "step rewards plus the final score), baselined against the group's episodes at the same turn index.",
    )
    loss: Literal["ppo_clip", "cispo", "sapo", "dppo_tv"] = Field(
        "ppo_clip",
        description="Policy loss: ppo_clip (PPO/GRPO/DAPO clip with clip_low/clip_high); cispo (clipped, detached IS "
        "weight x log-prob, MiniMax-M1); sapo (sigmoid-gated soft clip); dppo_tv (total-variation trust-region mask "
        "against the sampler, prime-rl's default).",
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="PPO ratio per token (GRPO/DAPO) or per sequence (GSPO: geometric mean)."
    )
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean",
        description="How per-token losses become one number: token-mean (DAPO), seq-mean-token-mean (GRPO), "
        "seq-mean-token-sum, or seq-mean-token-sum-norm (Dr.GRPO: / sampling.max_tokens).",
    )
    ppo_epochs: int = Field(1, ge=1, le=16, description="Passes over each batch.")
    minibatches: int = Field(1, ge=1, le=4096, description="Optimizer steps per pass (groups split evenly).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Estimator of KL(policy || ref).")
    kl_in: Literal["loss", "reward"] = Field(
        "loss", description="KL term in the loss, or subtracted from each completion's reward (detached)."
    )
    entropy_coef: float = Field(0.0, ge=0.0, le=1.0, description="Entropy bonus weight (token-mean entropy).")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal (counted as dropped_zero_variance)."
    )
    mismatch: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop", "geo_mask", "m2po", "none"
    ] = Field(
        "token_truncate",
        validate_default=True,
        description="Sampler/trainer correction: importance weight trainer/sampler per token or sequence, "
        "truncated at tis_cap or masked (zeroed) outside [mismatch_min, tis_cap]; icepop: token weights zeroed "
        "outside [icepop_low, icepop_high]; geo_mask: sequences rejected whose geometric-mean ratio is outside "
        "[geo_low, geo_high]; m2po: the tokens with the largest squared log-ratio masked until the batch's "
        "second moment is at most m2po_tau (for data many versions old).",
    )
    mismatch_min: float = Field(0.0, ge=0.0, le=1.0, description="Lower bound of the mismatch weight.")
    cispo_min: float = Field(0.0, ge=0.0, lt=1.0, description="cispo: lower bound of the clipped IS weight.")
    cispo_max: float = Field(
        5.0, gt=1.0, le=100.0, description="cispo: upper bound of the clipped IS weight (TRL epsilon_high, ScaleRL 5)."
    )
    sapo_tau_pos: float = Field(1.0, gt=0.0, le=100.0, description="sapo: gate temperature where advantage > 0.")
    sapo_tau_neg: float = Field(1.05, gt=0.0, le=100.0, description="sapo: gate temperature where advantage <= 0.")
    dppo_low: float = Field(
        0.2,
        gt=0.0,
        le=1.0,
        description="dppo_tv: mask a token with advantage < 0 whose probability fell more than this.",
    )
    dppo_high: float = Field(
        0.2,
        gt=0.0,
        le=1.0,
        description="dppo_tv: mask a token with advantage > 0 whose probability rose more than this.",
    )
    icepop_low: float = Field(0.5, ge=0.0, lt=1.0, description="icepop: lowest trainer/sampler ratio kept.")
    icepop_high: float = Field(2.0, gt=1.0, le=100.0, description="icepop: highest trainer/sampler ratio kept.")
    geo_low: float = Field(0.99, gt=0.0, lt=1.0, description="geo_mask: lowest geometric-mean ratio kept.")
    geo_high: float = Field(1.01, gt=1.0, le=10.0, description="geo_mask: highest geometric-mean ratio kept.")
    m2po_tau: float = Field(
        0.04, gt=0.0, le=10.0, description="m2po: bound on the batch's mean squared log-ratio (the paper's 0.04)."
    )
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="LR after warmup.")
    warmup_steps: int = Field(0, ge=0, le=1_000_000, description="Linear LR warmup, in optimizer steps.")
    finetune: Literal["lora", "full"] = Field("lora", description="LoRA adapter (all linear layers) or all weights.")
    distill_reward_weight: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="distill only: weight of the verifier's group-relative (GRPO) advantage added to every "
        "token's distillation advantage; 0 distills from the teacher alone.",
    )

    @field_validator("ratio_level")
    @classmethod
    def _ratio_level_fits_loss(cls, v: str, info: ValidationInfo) -> str:
        loss = info.data.get("loss")
        if v == "sequence" and loss in ("cispo", "dppo_tv"):
            raise ValueError(
                f"algorithm.ratio_level = 'sequence' (GSPO) works with algorithm.loss 'ppo_clip' or 'sapo', not "
                f"{loss!r}; use ratio_level 'token'"
            )
        return v

    @field_validator("mismatch")
    @classmethod
    def _mismatch_fits_loss(cls, v: str, info: ValidationInfo) -> str:
        if info.data.get("loss") == "dppo_tv" and v != "none":
            raise ValueError(
                f"algorithm.loss = 'dppo_tv' takes its ratio and trust region against the sampler already, so a "
                f"mismatch correction would count it twice: set algorithm.mismatch = 'none' (not {v!r})"
            )
        return v

    @field_validator("mismatch_min")
    @classmethod
    def _mismatch_min_fits(cls, v: float, info: ValidationInfo) -> float:
        mode = info.data.get("mismatch")
        if v != 0.0 and mode in ("icepop", "geo_mask", "m2po"):
            bounds = {"icepop": "icepop_low", "geo_mask": "geo_low", "m2po": "m2po_tau"}[mode]
            raise ValueError(
                f"algorithm.mismatch_min bounds the token_* and sequence_* modes; mismatch {mode!r} takes {bounds}"
            )
        return v

    @field_validator(*_OPTION_OF)
    @classmethod
    def _option_needs_its_choice(cls, v: float, info: ValidationInfo) -> float:
        name = info.field_name or ""
        owner, choice = _OPTION_OF[name]
        picked = info.data.get(owner)
        if picked is not None and picked != choice and v != cls.model_fields[name].default:
            raise ValueError(f"algorithm.{name} applies to algorithm.{owner} = {choice!r}, not {picked!r}")
        return v
