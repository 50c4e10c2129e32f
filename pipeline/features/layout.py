"""The layout of the HEP feature datasets: names, caps and sizes, and the class labels.

The one source of these constants for every layer that touches the features: the feature
kernels (``pipeline.features.delphes``), the scaling statistics, the Spark stage, the simulated
samples' labels, the shard reader and the models. It imports nothing.

* HLF: :data:`N_HLF` (14) high-level features, named :data:`HLF_NAMES`.
* LLF: :data:`N_PARTICLES` (801) rows of :data:`N_LLF_FEATURES` (19) features, named
  :data:`LLF_NAMES`, flattened particle-major into :data:`LLF_SIZE` (15,219) floats. Row 0 is
  the selected lepton, then at most :data:`CAPS` tracks, photons and neutral hadrons, then zero
  rows; ``n_particles`` counts the real rows. ``llf/`` (schema v3) stores only the real rows;
  readers pad to :data:`LLF_SIZE`.
* Classes: :data:`CLASS_NAMES` (QCD=0, ttbar=1, W+jets=2); :data:`CLASS_LABELS` also accepts the
  aliases a sample name may use.
"""
from __future__ import annotations

HLF_NAMES: tuple[str, ...] = ("HT", "MET", "phiMET", "MT", "nJets", "nBjets", "LepPt", "LepEta", "LepPhi",
                              "LepIsoCh", "LepIsoGamma", "LepIsoNeu", "LepCharge", "LepIsEle")
LLF_NAMES: tuple[str, ...] = ("Energy", "Px", "Py", "Pz", "Pt", "Eta", "Phi", "vtxX", "vtxY", "vtxZ", "ChPFIso",
                              "GammaPFIso", "NeuPFIso", "isChHad", "isNeuHad", "isGamma", "isEle", "isMu", "Charge")
N_HLF: int = len(HLF_NAMES)                     # 14
N_LLF_FEATURES: int = len(LLF_NAMES)            # 19
#: at most this many particles of each kind enter the LLF (the highest pT ones)
CAPS: dict[str, int] = {"tracks": 450, "photons": 150, "neutrals": 200}
N_PARTICLES: int = 1 + sum(CAPS.values())      # 801: the lepton row + the capped particles
LLF_SIZE: int = N_PARTICLES * N_LLF_FEATURES    # 15,219

#: class name -> label, in label order (the simulated processes carry these names)
CLASS_NAMES: tuple[str, ...] = ("qcd", "ttbar", "wjets")
N_CLASSES: int = len(CLASS_NAMES)
#: every accepted spelling of a class (lower case) -> its label
CLASS_LABELS: dict[str, int] = {**{name: i for i, name in enumerate(CLASS_NAMES)}, "tt": 1, "w+jets": 2}
