"""A simulated target website for tests, the demo and benchmarks."""

from jetfleet.simulator.app import TargetSimulator
from jetfleet.simulator.config import SimulatorConfig

__all__ = ["SimulatorConfig", "TargetSimulator"]
