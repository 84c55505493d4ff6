"""Strategies as the benches write them (``ddp``, ``diloco:100``, ``sparta:0.005``, ``demo:32``,
``streaming_diloco:100:4``, ``sparseloco:30``): how a bench runs each (profile overrides) and
how the projection models it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from distributed.planning.projection import demo_payload_bytes
from exogym.strategy.facts import (
    DEMO_CHUNK,
    DEMO_TOPK,
    DILOCO_H,
    SPARSELOCO_H,
    SPARTA_P,
    STREAMING_FRAGMENTS,
)

DEMO_DEFAULTS = {"compression_topk": DEMO_TOPK, "compression_chunk": DEMO_CHUNK}


@dataclass(frozen=True)
class StrategyCase:
    """One strategy as the benchmark runs it and the projection models it.

    Args:
        label: how tables name it (``DiLoCo H=100``).
        name: the profile's ``strategy`` value and the projection's name.
        settings: the strategy's own profile keys (``H``, ``p_sparta``, ...).
        period: steps from one communication to the next.
        compute: which baseline without communication gives its compute time:
            ``adamw`` (local AdamW steps: DDP, DiLoCo) or the strategy's own name
            (``sparta``, ``demo``: the strategy itself with mirrored collectives, so
            its local work per step -- SPARTA's index selection, DeMo's transform --
            counts as compute).
    """

    label: str
    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    period: int = 1
    compute: str = "adamw"

    @property
    def slug(self) -> str:
        """A file-name-safe name: ``diloco-h100``."""
        return self.label.lower().replace(" ", "-").replace("=", "").replace(".", "")

    def overrides(self) -> list[str]:
        """The profile overrides that select this strategy."""
        return [f"strategy={self.name}", *(f"{k}={v}" for k, v in self.settings.items())]

    def projection_settings(self, shapes: Sequence[Sequence[int]] | None = None,
                            demo_payload: float | None = None) -> dict[str, Any]:
        """Keyword arguments for ``distributed.planning.projection`` functions.

        Args:
            shapes: the model's trainable tensor shapes (sizes DeMo's payload).
            demo_payload: DeMo's bytes per host per step, instead of ``shapes``.
        """
        if self.name == "diloco":
            return {"H": self.settings["H"]}
        if self.name == "streaming_diloco":
            return {"H": self.settings["H"], "num_fragments": self.settings["num_fragments"]}
        if self.name == "sparseloco":
            if shapes is None:
                raise ValueError("SparseLoCo's projection needs the model's tensor shapes "
                                 "(results JSON): its payload is sized per tensor")
            return {"H": self.settings["H"], "shapes": [list(s) for s in shapes]}
        if self.name == "sparta":
            return {"p_sparta": self.settings["p_sparta"]}
        if self.name == "demo":
            if demo_payload is not None:
                return {"demo_payload": demo_payload}
            if shapes is None:
                raise ValueError("DeMo's projection needs the model's tensor shapes "
                                 "(results JSON) or --demo-payload")
            chunk = self.settings.get("compression_chunk", DEMO_DEFAULTS["compression_chunk"])
            topk = self.settings.get("compression_topk", DEMO_DEFAULTS["compression_topk"])
            return {"demo_payload": demo_payload_bytes(shapes, chunk, topk)}
        return {}


#: How to write each strategy, for the error that refuses a spec.
SPEC_HELP = ("ddp, diloco[:H] (e.g. diloco:100), streaming_diloco[:H[:FRAGMENTS]] "
             "(e.g. streaming_diloco:100:4), sparseloco[:H] (e.g. sparseloco:30), "
             "sparta or sparta:P (e.g. sparta:0.005), demo or demo:TOPK")


def _whole(text: str, default: int) -> int:
    """``text`` as a whole number >= 1 (``default`` when empty); ValueError otherwise."""
    value = int(text) if text else default
    if value < 1:
        raise ValueError
    return value


def parse_strategy(spec: str, p_sparta: float = SPARTA_P) -> StrategyCase:
    """``ddp``, ``diloco[:H]``, ``streaming_diloco[:H[:FRAGMENTS]]``, ``sparseloco[:H]``,
    ``sparta[:p]`` or ``demo[:topk]`` as a :class:`StrategyCase`; a part left out takes the
    strategy's default (DiLoCo and Streaming DiLoCo H=100, 4 fragments; SparseLoCo H=30).

    Streaming DiLoCo's and SparseLoCo's local work beyond AdamW (a fragment's outer step,
    SparseLoCo's top-k and quantization) happens once per round, so their compute baseline
    is AdamW's and that work counts in the comm share.
    """
    name, _, arg = spec.strip().lower().partition(":")
    try:
        if name == "ddp" and not arg:
            return StrategyCase("DDP", "ddp")
        if name == "diloco":
            H = _whole(arg, DILOCO_H)
            return StrategyCase(f"DiLoCo H={H}", "diloco", {"H": H}, period=H)
        if name in ("streaming_diloco", "streaming-diloco"):
            h_text, _, f_text = arg.partition(":")
            H, fragments = _whole(h_text, DILOCO_H), _whole(f_text, STREAMING_FRAGMENTS)
            if fragments > H:
                raise ValueError
            return StrategyCase(f"Streaming DiLoCo H={H} F={fragments}", "streaming_diloco",
                                {"H": H, "num_fragments": fragments}, period=H)
        if name == "sparseloco":
            H = _whole(arg, SPARSELOCO_H)
            return StrategyCase(f"SparseLoCo H={H}", "sparseloco", {"H": H}, period=H)
        if name == "sparta":
            p = float(arg) if arg else p_sparta
            if not 0 < p <= 1:
                raise ValueError
            return StrategyCase(f"SPARTA p={p:g}", "sparta", {"p_sparta": p}, compute="sparta")
        if name == "demo":
            settings = {"compression_topk": int(arg)} if arg else {}
            topk = settings.get("compression_topk", DEMO_DEFAULTS["compression_topk"])
            if topk < 1:
                raise ValueError
            return StrategyCase(f"DeMo top-{topk}", "demo", settings, compute="demo")
    except ValueError:
        pass
    raise ValueError(f"strategy {spec!r} is not understood: write {SPEC_HELP}")


def parse_strategies(text: str, p_sparta: float = SPARTA_P) -> list[StrategyCase]:
    """A comma-separated list of strategies."""
    cases = [parse_strategy(s, p_sparta) for s in text.split(",") if s.strip()]
    if not cases:
        raise ValueError("no strategy given: e.g. --strategies ddp,diloco:100")
    return cases
