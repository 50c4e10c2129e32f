"""Simulated HEP samples: Pythia 8 ttbar / W+jets / QCD events -> particle-level detector model ->
Delphes-layout ROOT files (tree ``Delphes``, branches ``Electron.PT``, ``Jet.BTag``, ...).

    from pipeline.simulate import SimulateConfig, generate
    out = generate(SimulateConfig(events=2000, output="runs/hep/simulated"))
    out["files"]["ttbar"]        # list of ROOT files of that class

Modules: ``config`` (SimulateConfig), ``generator`` (Pythia settings, seeds, batched generation
with the lepton filter), ``detector`` (the vectorised detector model), ``delphes_io`` (schema +
uproot writer), ``stage`` (tasks on Spark, progress, atomic output, sidecar JSON).
See docs/simulation.md.
"""
from .config import DetectorConfig, LeptonFilterConfig, SimulateConfig, SmearingConfig

__all__ = ["SimulateConfig", "DetectorConfig", "SmearingConfig", "LeptonFilterConfig", "generate",
           "plan_generate", "make_tasks", "run_task"]


def __getattr__(name):  # heavy imports (numpy, Spark helpers) only when the stage is used
    if name in ("generate", "plan_generate", "make_tasks", "run_task"):
        from . import stage

        return getattr(stage, name)
    raise AttributeError(name)
