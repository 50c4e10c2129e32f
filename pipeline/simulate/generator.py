"""Pythia 8 event generation for the three classes, in batches of awkward arrays.

One :class:`ProcessGenerator` owns one Pythia instance (one per Spark task). Events come out of
``Pythia.nextBatch`` as awkward arrays of whole event records (every particle with its id,
status, mothers, four-momentum and production vertex), so the detector model runs vectorised
over many events at once. An optional generator-level lepton filter keeps only events with a
final-state electron or muon above a pT threshold; the number of attempts is counted so the
filter efficiency can be reported.

Processes (13 TeV pp by default):

* ``ttbar``: ``Top:gg2ttbar`` + ``Top:qqbar2ttbar``, all top and W decays.
* ``wjets``: ``WeakBosonAndParton:qqbar2Wg`` + ``qg2Wq`` (W + 1 parton at LO, pTHat > wjets_pthat_min),
  W -> e nu / mu nu only.
* ``qcd``: lepton-enriched heavy-flavour QCD: ``HardQCD:hardbbbar`` (pTHat > qcd_pthat_min) and, by
  default, every weakly decaying B hadron forced into decay channels with an electron or muon
  (``onIfAny = 11 13``). The generator lepton filter then selects the events with a hard lepton.

Seeds: :func:`derive_seeds` maps (run seed, process, task index) to a Pythia seed and a numpy
seed, so a task's events depend on nothing else (not on the number of executors or tasks
running beside it).
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from ..features.layout import CLASS_LABELS

PYTHIA_MAX_SEED = 900_000_000
B_HADRONS_WEAK = (511, 521, 531, 541, 5122, 5132, 5232, 5332)

COMMON_SETTINGS = (
    "Next:numberCount = 0",
    "Next:numberShowEvent = 0",
    "Next:numberShowInfo = 0",
    "Next:numberShowProcess = 0",
    "Print:quiet = on",
    # particles with c*tau > 10 mm (K0S, Lambda, ...) are left stable, as in LHC generator setups
    "ParticleDecays:limitTau0 = on",
    "ParticleDecays:tau0Max = 10",
)


def derive_seeds(run_seed: int, process: str, task_index: int) -> tuple[int, int]:
    """(Pythia seed in [1, 900,000,000], numpy seed) for one task; pure function of its arguments."""
    state = np.random.SeedSequence([int(run_seed), CLASS_LABELS[process], int(task_index)]).generate_state(
        2, dtype=np.uint64)
    return int(state[0] % PYTHIA_MAX_SEED) + 1, int(state[1])


def process_settings(process: str, *, ecm: float = 13000.0, qcd_pthat_min: float = 50.0,
                     qcd_force_semileptonic: bool = True, wjets_pthat_min: float = 20.0,
                     extra: list[str] | None = None) -> list[str]:
    """The Pythia ``readString`` lines of one process (without the seed)."""
    s = [f"Beams:eCM = {ecm:g}", *COMMON_SETTINGS]
    if process == "ttbar":
        s += ["Top:gg2ttbar = on", "Top:qqbar2ttbar = on"]
    elif process == "wjets":
        s += ["WeakBosonAndParton:qqbar2Wg = on", "WeakBosonAndParton:qg2Wq = on",
              f"PhaseSpace:pTHatMin = {wjets_pthat_min:g}", "24:onMode = off", "24:onIfAny = 11 13"]
    elif process == "qcd":
        s += ["HardQCD:hardbbbar = on", f"PhaseSpace:pTHatMin = {qcd_pthat_min:g}"]
        if qcd_force_semileptonic:
            for b in B_HADRONS_WEAK:
                s += [f"{b}:onMode = off", f"{b}:onIfAny = 11 13"]
    else:
        raise ConfigError(f"unknown process {process!r}")
    return s + list(extra or [])


@contextlib.contextmanager
def quiet_stdout():
    """Silence C++ banners written to fd 1 (Pythia / fastjet) while initialising."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


@dataclass
class Batch:
    """Generated events: ``prt`` (per-event particle records) and ``info`` (per-event hard-process info)."""

    prt: object
    info: object


@dataclass
class ProcessGenerator:
    """One Pythia instance generating (optionally lepton-filtered) events of one process."""

    process: str
    settings: list[str]
    seed: int
    filter_pt: float | None = None      # None: no generator filter
    filter_eta: float = 2.5
    attempts: int = 0                   # events Pythia generated
    passed: int = 0                     # of which passed the filter
    _pythia: object = field(default=None, repr=False)
    _pending: list = field(default_factory=list, repr=False)
    _n_pending: int = 0

    def __post_init__(self):
        import pythia8mc

        with quiet_stdout():
            p = pythia8mc.Pythia("", False)
            for line in [*self.settings, "Random:setSeed = on", f"Random:seed = {self.seed}"]:
                if not p.readString(line):
                    raise ConfigError(f"pythia setting rejected for {self.process}: {line!r}")
            if not p.init():
                raise ConfigError(f"Pythia failed to initialise for {self.process} (settings: {self.settings})")
        self._pythia = p

    @property
    def pythia(self):
        return self._pythia

    def charge_of(self, pdg_ids: np.ndarray) -> np.ndarray:
        """Electric charge of each PDG id (vectorised through a lookup of the unique ids)."""
        uniq, inv = np.unique(pdg_ids, return_inverse=True)
        pd = self._pythia.particleData
        table = np.array([pd.charge(int(i)) for i in uniq], dtype=np.float64)
        return table[inv] if len(uniq) else np.zeros(0)

    def _passes_filter(self, prt) -> np.ndarray:
        import awkward as ak

        lep = prt[(prt.status > 0) & ((abs(prt.id) == 11) | (abs(prt.id) == 13))]
        pt = np.hypot(lep.p.px, lep.p.py)
        eta = np.arcsinh(lep.p.pz / np.maximum(pt, 1e-12))
        return ak.to_numpy(ak.any((pt > self.filter_pt) & (abs(eta) < self.filter_eta), axis=1))

    def generate(self, n: int, batch_size: int = 100, max_attempts: int | None = None) -> Batch:
        """Exactly ``n`` events (after the filter), generated ``batch_size`` at a time.

        Events that pass the filter beyond ``n`` are kept for the next call, so the sequence of
        events of one generator does not depend on how it is cut into calls.
        """
        import awkward as ak

        fields = ["id", "status", "mother1", "mother2", "p", "vProd"]
        limit = self.attempts + (max_attempts or 200 * n)
        while self._n_pending < n:
            if self.attempts >= limit:
                raise ConfigError(f"{self.process}: only {self.passed} events passed the lepton filter in "
                                  f"{self.attempts} attempts (lower lepton_filter.pt_min or raise "
                                  f"max_attempts_factor)")
            k = batch_size if self.filter_pt is not None else min(batch_size, n - self._n_pending)
            b = self._pythia.nextBatch(k)
            self.attempts += k
            prt, info = b.prt[fields], b.info
            if self.filter_pt is not None:
                keep = self._passes_filter(prt)
                prt, info = prt[keep], info[keep]
            self.passed += len(prt)
            self._pending.append((prt, info))
            self._n_pending += len(prt)
        prt = ak.concatenate([p for p, _ in self._pending]) if len(self._pending) > 1 else self._pending[0][0]
        info = ak.concatenate([i for _, i in self._pending]) if len(self._pending) > 1 else self._pending[0][1]
        self._pending = [(prt[n:], info[n:])] if len(prt) > n else []
        self._n_pending = len(prt) - n
        return Batch(prt=ak.to_packed(prt[:n]), info=ak.to_packed(info[:n]))

    @property
    def filter_efficiency(self) -> float:
        """Fraction of generated events that passed the lepton filter (1.0 without filter)."""
        return self.passed / self.attempts if self.attempts else float("nan")

    def cross_section_pb(self) -> float:
        """Pythia's estimate of the generated cross section (before the lepton filter) in pb."""
        return float(self._pythia.infoPython().sigmaGen()) * 1e9
