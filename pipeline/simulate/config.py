"""Configuration of the simulation stage (``jobs/simulate.py``, ``configs/simulate.yaml``).

:class:`SimulateConfig` says *what* to generate (processes, events, seed, where to write) and
nests :class:`DetectorConfig` (the particle-level detector model, with its b-tagging and
optional :class:`SmearingConfig` resolution model) and :class:`LeptonFilterConfig` (the
generator-level lepton filter). Every number of the detector model lives here, with the
meaning documented in ``docs/simulation.md``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config import StageConfig

Process = Literal["ttbar", "wjets", "qcd"]
PROCESSES: tuple[str, ...] = ("ttbar", "wjets", "qcd")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SmearingConfig(_Strict):
    """Gaussian resolution model, applied to every reconstructed candidate before jets and MET.

    Tracks (and so electrons and muons): sigma(pT)/pT = track_a (+) track_b * pT.
    Photons: sigma(E)/E = photon_stochastic / sqrt(E) (+) photon_constant.
    Neutral hadrons: sigma(E)/E = hadron_stochastic / sqrt(E) (+) hadron_constant.
    ((+) is the sum in quadrature; the four-momentum is scaled, the direction kept.)
    """

    enabled: bool = Field(True, description="smear candidate momenta (false: perfect resolution)")
    track_a: float = Field(0.01, ge=0, description="track pT resolution, constant term")
    track_b: float = Field(2e-4, ge=0, description="track pT resolution, term proportional to pT [1/GeV]")
    photon_stochastic: float = Field(0.05, ge=0, description="photon energy resolution, stochastic term [sqrt(GeV)]")
    photon_constant: float = Field(0.01, ge=0, description="photon energy resolution, constant term")
    hadron_stochastic: float = Field(1.0, ge=0, description="neutral hadron energy resolution, stochastic term [sqrt(GeV)]")
    hadron_constant: float = Field(0.05, ge=0, description="neutral hadron energy resolution, constant term")


class DetectorConfig(_Strict):
    """The particle-level detector model (see docs/simulation.md)."""

    track_pt_min: float = Field(0.5, ge=0, description="charged particles above this pT [GeV] become tracks")
    track_eta_max: float = Field(2.5, gt=0, description="tracker acceptance |eta|")
    calo_eta_max: float = Field(4.9, gt=0, description="calorimeter acceptance |eta|")
    calo_et_min: float = Field(1.0, ge=0, description="photons / neutral hadrons above this ET [GeV] are kept")
    lepton_pt_min: float = Field(10.0, ge=0, description="electrons and muons above this pT [GeV] are reconstructed")
    lepton_eta_max: float = Field(2.5, gt=0, description="lepton acceptance |eta|")
    electron_efficiency: float = Field(0.95, ge=0, le=1, description="electron identification efficiency")
    muon_efficiency: float = Field(0.95, ge=0, le=1, description="muon identification efficiency")
    isolation_cone: float = Field(0.3, gt=0, description="lepton isolation cone radius dR")
    jet_radius: float = Field(0.4, gt=0, description="anti-kt jet radius R")
    jet_pt_min: float = Field(20.0, ge=0, description="jets above this pT [GeV] are kept")
    btag_eta_max: float = Field(2.5, gt=0, description="b-tagging acceptance |eta|")
    btag_efficiency: float = Field(0.7, ge=0, le=1, description="b-tag probability of a jet holding B-hadron decay products")
    btag_mistag_c: float = Field(0.1, ge=0, le=1, description="b-tag probability of a c jet")
    btag_mistag_light: float = Field(0.01, ge=0, le=1, description="b-tag probability of a light jet")
    smearing: SmearingConfig = Field(default_factory=SmearingConfig)


class LeptonFilterConfig(_Strict):
    """Generator-level filter: keep an event only if it has a final-state electron or muon
    with pT > pt_min and |eta| < eta_max (before the detector model)."""

    processes: list[Process] = Field(default_factory=lambda: list(PROCESSES),
                                     description="processes the filter applies to")
    pt_min: float = Field(20.0, ge=0, description="generator lepton pT threshold [GeV]")
    eta_max: float = Field(2.5, gt=0, description="generator lepton |eta| acceptance")


class SimulateConfig(StageConfig):
    """Generate ttbar / W+jets / QCD events with Pythia 8 and write Delphes-layout ROOT files."""

    processes: list[Process] = Field(default_factory=lambda: list(PROCESSES),
                                     description="processes to generate (ttbar, wjets, qcd)")
    events: int = Field(3000, gt=0, description="events written per process (after the lepton filter)")
    seed: int = Field(12345, ge=0, description="run seed; task seeds derive from (seed, process, task index)")
    output: str = Field("runs/hep/simulated", description="output directory (replaced atomically)")
    events_per_file: int = Field(500, gt=0, description="events per ROOT file; one Spark task writes one file")
    batch_size: int = Field(100, gt=0, description="events Pythia generates per nextBatch call")
    ecm: float = Field(13000.0, gt=0, description="centre-of-mass energy [GeV]")
    qcd_pthat_min: float = Field(50.0, ge=0, description="QCD (b bbar) minimum hard-process pT [GeV]")
    qcd_force_semileptonic: bool = Field(True, description="force B hadrons to decay semileptonically (e/mu) in QCD")
    wjets_pthat_min: float = Field(20.0, ge=0, description="W+jet minimum hard-process pT [GeV]")
    max_attempts_factor: int = Field(200, gt=0, description="give up a task after this many times its events")
    pythia: dict[str, list[str]] = Field(default_factory=dict,
                                         description="extra Pythia settings per process, appended last")
    lepton_filter: LeptonFilterConfig = Field(default_factory=LeptonFilterConfig)
    detector: DetectorConfig = Field(default_factory=DetectorConfig)
    overwrite: bool = Field(True, description="replace an existing output directory")
    progress: bool = Field(True, description="show a progress bar of generated events on the driver")

    @field_validator("processes")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one process is needed")
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate process in {v}")
        return v

    @field_validator("pythia")
    @classmethod
    def _known(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for k in v:
            if k not in PROCESSES:
                raise ValueError(f"unknown process {k!r} (known: {', '.join(PROCESSES)})")
        return v
