"""The reward service's scorer: the shared deadline scorer (shared/domain/scoring.py), which
rollout's held-out evaluation uses too (a role never imports another role)."""

from shared.domain.scoring import GroupWork, Scorer, failed, score_json, score_work

__all__ = ["GroupWork", "Scorer", "failed", "score_json", "score_work"]
