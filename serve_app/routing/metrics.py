"""The prefix-affinity router's metrics, through Ray Serve's metrics API.

Exported by every process the router runs in (the ReplicaPicker's replicas; under a bare
``serve run``, Serve's proxy), tagged with the model.

Runs in each ReplicaPicker replica, with the router.
"""

from __future__ import annotations

from serve_app.observability.gauges import RefreshedGauges, refreshed_gauges
from serve_app.routing.prefix_table import Decision
from serve_app.serve_internals import start_at_zero

# Names as exported (Ray adds the "ray_" prefix).
PREFIX_ROUTING_DECISIONS = "glm4_serve_prefix_routing_decisions"
PREFIX_ROUTING_BLOCKS = "glm4_serve_prefix_routing_blocks"


class PrefixRoutingMetrics:
    """What a model deployment's prefix-affinity router decided, in the process it runs in.

    ``decision`` is one of :class:`serve_app.routing.prefix_table.Decision`: ``affinity`` and
    ``home`` went where the prompt's prefix is (or belongs), ``fallback`` went by load because
    that replica was too busy, ``by_load`` had nothing to prefer.
    """

    DECISIONS = tuple(decision.value for decision in Decision)

    def __init__(self, model: str, gauges: RefreshedGauges | None = None) -> None:
        from ray.serve.metrics import Counter, Gauge

        self._model = {"model": model}
        self.decisions = Counter(
            PREFIX_ROUTING_DECISIONS,
            "Generation requests routed to a model replica, by how the prefix-affinity router chose it.",
            tag_keys=("model", "decision"),
        )
        self.blocks = Gauge(
            PREFIX_ROUTING_BLOCKS,
            "Prompt-prefix blocks the router remembers replicas for (bounded by prefix_routing.max_blocks).",
            tag_keys=("model",),
        )
        self._gauges = gauges or refreshed_gauges()
        for decision in self.DECISIONS:
            start_at_zero(self.decisions, self._model | {"decision": decision})
        self._gauges.set(self.blocks, 0, self._model)

    def routed(self, decision: str, blocks: int) -> None:
        self.decisions.inc(tags=self._model | {"decision": decision})
        self._gauges.set(self.blocks, blocks, self._model)


def prefix_routing_names() -> set[str]:
    """The sample names of :class:`PrefixRoutingMetrics` (exported by the processes a
    prefix-routed model's router runs in)."""
    return {f"ray_{PREFIX_ROUTING_DECISIONS}_total", f"ray_{PREFIX_ROUTING_BLOCKS}"}
