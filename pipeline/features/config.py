"""The settings of the feature stage (``jobs/features.py``, ``configs/features.yaml``): the
physics samples and their labels, the split, the Parquet sizes, the work files."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..config import StageConfig
from ..ingest.root import FILE_TIMEOUT_S, StepSize
from .layout import CLASS_LABELS, N_CLASSES


class SampleSpec(BaseModel):
    """One physics sample: a label and the files (paths/globs) that belong to it."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., description="sample name (free text, e.g. ttbar)")
    label: int = Field(..., ge=0, le=N_CLASSES - 1, description="class label: QCD=0, ttbar=1, W+jets=2 (or the class name)")
    files: list[str] = Field(..., min_length=1, description="paths/globs of this sample's ROOT files")

    @field_validator("label", mode="before")
    @classmethod
    def _label(cls, v):
        if isinstance(v, str) and not v.strip().isdigit():
            key = v.strip().lower()
            if key not in CLASS_LABELS:
                raise ValueError(f"unknown class {v!r} (use 0/1/2 or qcd/ttbar/wjets)")
            return CLASS_LABELS[key]
        return v


#: the events ``make run`` ingests (``configs/ingest_root.yaml``): the input when neither input nor samples is given
DEFAULT_INPUT = "runs/hep/events"


def _default_samples() -> list["SampleSpec"]:
    """The classes of the generated events (``configs/features.yaml``): by the generator's folders
    (``<process>/<process>_NNNN.root``) or file names; coffea's ``delphes.root`` stands in for ttbar."""
    return [SampleSpec(name="qcd", label=0, files=["*/qcd/*.root", "qcd*.root"]),
            SampleSpec(name="ttbar", label=1, files=["*/ttbar/*.root", "ttbar*.root", "samples:delphes.root"]),
            SampleSpec(name="wjets", label=2, files=["*/wjets/*.root", "wjets*.root"])]


class FeaturesConfig(StageConfig):
    """Settings of ``jobs/features.py``."""

    input: Optional[Union[str, list[str]]] = Field(
        None, description="ingested dataset dir(s) (ingest_root output, Parquet or a Delta table) or ROOT "
                          "paths/globs; default: the "
                          f"files of samples when samples are given, else {DEFAULT_INPUT} (written by `make run`)")
    input_version: Optional[int] = Field(None, ge=0, description="a Delta table input (ingest_root with "
                                         "output_format: delta): the version to read (time travel; default: the "
                                         "newest)")
    samples: list[SampleSpec] = Field(default_factory=_default_samples, min_length=1,
                                      description="label of each file: the first sample with a matching path/glob "
                                                  "(QCD=0, ttbar=1, W+jets=2; default: the generated classes)")
    tree: str = Field("Delphes", description="TTree or RNTuple name when reading ROOT files")
    output: str = Field("runs/hep/features", description="output dir: hlf/, llf/, scaling.json, report.json")
    output_format: Literal["parquet", "delta"] = Field(
        "parquet", description="parquet: the output folder replaced whole; delta: hlf/ and llf/ are Delta tables, "
                               "each run a new version of both (docs/hep-features.md#outputs)")
    step_size: StepSize = Field("50 MB", description="ROOT chunk size (entries or '50 MB'); one task each")
    test_fraction: float = Field(0.2, ge=0, lt=1, description="fraction of each class in the test split")
    val_fraction: float = Field(0.1, ge=0, lt=1, description="fraction of each class in the val split")
    seed: int = Field(42, description="seed of the split and of the class balancing")
    balance_classes: bool = Field(False, description="undersample every split to its smallest non-empty class")
    allow_bad_files: bool = Field(False, description="exit 0 even if some files could not be used")
    hlf_row_group_mb: float = Field(8, gt=0, description="Parquet row group size of hlf/ [MiB]")
    llf_row_group_mb: float = Field(32, gt=0, description="Parquet row group size of llf/ [MiB]")
    file_mb: int = Field(256, gt=0, description="target Parquet file size [MiB] (sets the number of files)")
    schema_dir: Optional[str] = Field(None, description="schemas folder (default: the repository's schemas/)")
    file_timeout_s: float = Field(FILE_TIMEOUT_S, gt=0, description="seconds allowed to open one ROOT file and "
                                  "to read one chunk; longer: the file is reported as bad")
    work_compression: Literal["none", "lz4", "zstd"] = Field(
        "lz4", description="compression of the work files between the two Spark passes (Arrow IPC under the "
                           "output job's prefix, removed at the commit): lz4 stages fewer bytes, none spends "
                           "less CPU per event (docs/benchmarks.md#hep-features)")

    @model_validator(mode="after")
    def _default_input(self):
        if self.input is None and "samples" not in self.model_fields_set:   # the bare job: make run's events
            self.input = DEFAULT_INPUT
        return self

    @model_validator(mode="after")
    def _fractions(self):
        if self.test_fraction + self.val_fraction >= 1:
            raise ValueError(f"test_fraction + val_fraction = {self.test_fraction + self.val_fraction} must be < 1")
        return self
