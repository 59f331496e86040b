"""The front end: parse ``.pipe`` text, resolve names and types, evaluate with parameters."""
from pipec.dsl.parser import parse
from pipec.dsl.resolve import resolve
from pipec.dsl.schedule import ResolvedSchedule
from pipec.dsl.spec import GreedyPolicy, RingSpec, ScheduleSpec, WeightSpec

__all__ = ["parse", "resolve", "ResolvedSchedule", "ScheduleSpec", "GreedyPolicy", "WeightSpec", "RingSpec"]
