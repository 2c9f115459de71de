"""A simulated target website for tests, the demo and benchmarks."""

from jetfleet.simulator.app import TargetSimulator
from jetfleet.simulator.config import SimulatorConfig
from jetfleet.simulator.counters import Arrival, most_in_any_window

__all__ = ["Arrival", "SimulatorConfig", "TargetSimulator", "most_in_any_window"]
