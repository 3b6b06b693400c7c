from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict

from shared.settings import CommonSettings


def _modules(csv: str) -> list[str]:
    return [m.strip() for m in csv.split(",") if m.strip()]


class ApiSettings(CommonSettings):
    """api service settings (env prefix BURSTRL_API_, common ones BURSTRL_)."""

    model_config = SettingsConfigDict(env_prefix="BURSTRL_API_", extra="ignore", populate_by_name=True)

    feed_interval_s: float = Field(
        0.2,
        gt=0,
        description="Longest wait between prompt top-ups (the feeder also wakes when a job records progress).",
    )
    # The api checks a job's verifier, task and environment names at submission, so it
    # imports the same plugin modules as the services that run them: the same variables.
    reward_plugins: str = Field(
        "",
        validation_alias=AliasChoices("BURSTRL_REWARD_PLUGINS", "BURSTRL_API_REWARD_PLUGINS"),
        description="The reward service's plugin modules (verifiers, tasks), imported to check jobs at submission.",
    )
    env_plugins: str = Field(
        "",
        validation_alias=AliasChoices("BURSTRL_ROLLOUT_ENV_PLUGINS", "BURSTRL_API_ENV_PLUGINS"),
        description="The rollout service's environment plugin modules, imported to check jobs at submission.",
    )

    @property
    def reward_plugin_modules(self) -> list[str]:
        return _modules(self.reward_plugins)

    @property
    def env_plugin_modules(self) -> list[str]:
        return _modules(self.env_plugins)
