"""What the outer step at the end of a round did: the averages it applied (outer.py) and what they cost."""

from __future__ import annotations

from dataclasses import dataclass

from .average import Average, AverageKind

__all__ = ["Applied", "RoundOutcome"]


@dataclass(frozen=True)
class Applied:
    """An average the outer step used (or, for STRANDED/ABANDONED, did not) at a boundary."""

    round: int
    average: Average


@dataclass(frozen=True)
class RoundOutcome:
    """What the outer step at the end of a round did: the averages it took, and how long it waited."""

    applied: tuple[Applied, ...] = ()
    seconds_wait: float = 0.0

    def then(self, other: RoundOutcome) -> RoundOutcome:
        """This outcome followed by `other` at the same boundary (the drain of the last round)."""
        return RoundOutcome(self.applied + other.applied, self.seconds_wait + other.seconds_wait)

    @property
    def last(self) -> Average | None:
        return self.applied[-1].average if self.applied else None

    @property
    def applied_round(self) -> int | None:
        return self.applied[-1].round if self.applied else None

    @property
    def kind(self) -> AverageKind | None:
        return self.last.kind if self.last is not None else None

    @property
    def group_size(self) -> int | None:
        """The size of the group whose average was applied last (the record's `applied_round`)."""
        return self.last.group_size if self.last is not None else None

    @property
    def coverage(self) -> float:
        return min((a.average.coverage for a in self.applied), default=1.0)

    @property
    def bytes_sent(self) -> int:
        return sum(a.average.bytes_sent for a in self.applied)

    @property
    def bytes_received(self) -> int:
        return sum(a.average.bytes_received for a in self.applied)

    @property
    def window(self) -> tuple[float, float] | None:
        return self.last.window if self.last is not None else None

    @property
    def bytes_per_s(self) -> float:
        """Bytes sent and received per second of the exchange windows of the averages applied."""
        seconds = sum(a.average.window[1] - a.average.window[0] for a in self.applied if a.average.window)
        return (self.bytes_sent + self.bytes_received) / seconds if seconds > 0 else 0.0
