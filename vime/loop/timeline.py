"""The training timeline: steps and weight versions.

Version v is the weights after v optimizer steps (v = 0: the checkpoint). The trainer moves v -> v+1
at each step and every rollout token carries the version that produced it. In the synchronous loop the
rollout engines must acknowledge v+1 before the next rollout; in the asynchronous one
(`vime.loop.async_loop`) the next rollouts are already queued when they acknowledge it, and a token may be up
to `algo.max_staleness` versions behind the trainer.
"""

from __future__ import annotations

import dataclasses

from vime.errors import WeightSyncError


@dataclasses.dataclass
class Timeline:
    num_engines: int
    trainer_version: int = 0
    step: int = 0
    engine_versions: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.engine_versions:
            self.engine_versions = [0] * self.num_engines

    def trained(self) -> int:
        """The trainer finished an optimizer step: its weights are now version v+1."""
        self.trainer_version += 1
        return self.trainer_version

    def acknowledged(self, engine: int, version: int) -> None:
        """Engine `engine` reports that it now serves `version`."""
        if version != self.trainer_version:
            raise WeightSyncError(
                f"rollout engine {engine} acknowledged weight version {version}, "
                f"but the trainer is at version {self.trainer_version}"
            )
        self.engine_versions[engine] = version

    def check_ready_for_rollout(self) -> int:
        """Every engine serves the trainer's version (on-policy); returns that version."""
        behind = [(e, v) for e, v in enumerate(self.engine_versions) if v != self.trainer_version]
        if behind:
            raise WeightSyncError(
                f"rollout engines {behind} (engine, version) are behind the trainer's version "
                f"{self.trainer_version}: weight sync did not complete"
            )
        return self.trainer_version

    def finish_step(self) -> None:
        """The step is recorded: the timeline moves to the next one (the step's parity is in its StepRecord)."""
        self.step += 1
