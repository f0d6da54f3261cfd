"""Each run kind's part of the hot path, in one registry keyed by `RunKind`: the request a
slot sends for an item and the outcome its result records. The window asks the registry once
per claimed item (`policy_for(run)`, through its RunPolicy's `kind_policy`) and the slot only
calls the policy, so a new kind is a new policy class and one entry in `POLICIES`.

Generation (`RunKind.GENERATE`) is the first: `POST /generate` with the item's prompt ids and
its sample's sampling params (and its images), recorded as `Done` with the server's result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from app.core.contracts import GenerateResult, SamplingParams
from app.core.errors import ConfigurationError
from app.core.run_kinds import RunKind
from app.ledger import claims, outcomes, run_queries
from workers.engine.window_types import Checked, GenerateClient, KindPolicy


@dataclass(frozen=True)
class GenerationPolicy:
    """`RunKind.GENERATE`: sample the target's answer to the item's prompt."""

    sampling: SamplingParams

    def send(
        self,
        client: GenerateClient,
        item: claims.ClaimedItem,
        rid: str,
        images: list[str] | None,
        *,
        priority: int | None = None,
    ) -> GenerateResult:
        """The item's prompt ids and its sample's sampling params, and its images if any;
        priority: the request's (SGLang's own queue order), sent only when given."""
        params = self.sampling.for_sample(item.sample_index, item.row_sampling_params)
        if priority is not None:  # the server schedules by priority: its queue orders too
            return client.generate(
                item.prompt_ids, params, rid, image_data=images, priority=priority
            )
        if images is None:
            return client.generate(item.prompt_ids, params, rid)
        return client.generate(item.prompt_ids, params, rid, image_data=images)

    def outcome(
        self, item: claims.ClaimedItem, result: GenerateResult, checked: Checked, server: str
    ) -> outcomes.Done:
        """The result as written: the answer, the server that made it, an image item's counts."""
        return outcomes.Done(
            item.id,
            result,
            attempts_used=1,
            server=server,
            image_token_counts=checked.image_token_counts,
        )


def _generation(run: run_queries.RunInfo) -> KindPolicy:
    return GenerationPolicy(run.generation.sampling)


# one entry per RunKind: how the policy of a run of that kind is made from the run
POLICIES: Mapping[RunKind, Callable[[run_queries.RunInfo], KindPolicy]] = {
    RunKind.GENERATE: _generation,
}


def policy_for(run: run_queries.RunInfo) -> KindPolicy:
    """The policy of run's kind, bound to the run's settings."""
    make = POLICIES.get(run.kind)
    if make is None:
        raise ConfigurationError(f"run {run.name}: no policy serves runs of kind {run.kind!r}")
    return make(run)
