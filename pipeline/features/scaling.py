"""Per-feature standardisation fitted on the training split only (``scaling.json``).

Spark-ML-like: ``FeatureScaler().fit(df)`` returns a :class:`ScalingModel` (mean and standard
deviation per feature); the readers apply ``(x - mean) / std`` (``ScalingModel.transform_llf`` is
the numpy form). Unlike the
CERN code, which standardised the particles of each event on their own (turning the zero padding
into non-zero values), the LLF statistics are over the *real* particles of all training events
(rows ``< n_particles``) and padding stays exactly zero after the transform.

Both fits work from partial moments (count, mean and sum of squared deviations per feature,
:class:`Moments`, merged with Chan's parallel formula), computed where the rows are
(:func:`row_moments`): the feature stage's writer tasks return those of the train rows they
write, and ``FeatureScaler.fit`` fits any DataFrame in one Spark pass (``mapInArrow``: the same
partial moments per partition, merged on the driver), so the arrays never reach the driver. The artefact is the contract of the training stage, the pydantic
model :class:`ScalingFile`::

    {"hlf": {"mean": [14], "std": [14], "count": N}, "llf": {"mean": [19], "std": [19], "count": M}}

A feature with zero spread (or a split with no events) gets ``std = 1`` so that the transform
is defined; ``count`` says how many values the statistics came from.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Iterator, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import BadInputError
from ..outputs import read_json, write_json
from ..spark import spark_task
from .layout import LLF_SIZE, N_HLF, N_LLF_FEATURES, N_PARTICLES


_Mean = Annotated[float, Field(allow_inf_nan=False)]
_Std = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class HLFStats(BaseModel):
    """Statistics of the N_HLF high-level features over the train events."""

    model_config = ConfigDict(extra="forbid")
    mean: list[_Mean] = Field(..., min_length=N_HLF, max_length=N_HLF, description="mean of each feature")
    std: list[_Std] = Field(..., min_length=N_HLF, max_length=N_HLF,
                            description="standard deviation of each feature (1 where the spread is 0)")
    count: int = Field(0, ge=0, description="number of train events")


class LLFStats(BaseModel):
    """Statistics of the N_LLF_FEATURES particle features over the real particles of the train events."""

    model_config = ConfigDict(extra="forbid")
    mean: list[_Mean] = Field(..., min_length=N_LLF_FEATURES, max_length=N_LLF_FEATURES,
                              description="mean of each feature")
    std: list[_Std] = Field(..., min_length=N_LLF_FEATURES, max_length=N_LLF_FEATURES,
                            description="standard deviation of each feature (1 where the spread is 0)")
    count: int = Field(0, ge=0, description="number of real particles (padding rows excluded)")


class ScalingFile(BaseModel):
    """``scaling.json``: the standardisation statistics fitted on the train split."""

    model_config = ConfigDict(extra="forbid", title="scaling.json")
    hlf: HLFStats
    llf: LLFStats


@dataclass
class Moments:
    """Count, mean and M2 (sum of squared deviations) per feature; mergeable."""

    n: float
    mean: np.ndarray
    m2: np.ndarray

    @classmethod
    def empty(cls, features: int) -> "Moments":
        return cls(0.0, np.zeros(features), np.zeros(features))

    @classmethod
    def of(cls, x: np.ndarray) -> "Moments":
        x = np.asarray(x, dtype=np.float64)
        if len(x) == 0:
            return cls(0.0, np.zeros(x.shape[1]), np.zeros(x.shape[1]))
        mean = x.mean(axis=0)
        return cls(float(len(x)), mean, ((x - mean) ** 2).sum(axis=0))

    def merge(self, other: "Moments") -> "Moments":
        if other.n == 0:
            return self
        if self.n == 0:
            return other
        n = self.n + other.n
        d = other.mean - self.mean
        return Moments(n, self.mean + d * other.n / n, self.m2 + other.m2 + d * d * self.n * other.n / n)

    def std(self) -> np.ndarray:
        if self.n == 0:
            return np.ones_like(self.mean)
        s = np.sqrt(self.m2 / self.n)
        return np.where(s > 0, s, 1.0)


@dataclass
class ScalingModel:
    hlf_mean: np.ndarray
    hlf_std: np.ndarray
    llf_mean: np.ndarray
    llf_std: np.ndarray
    hlf_count: int = 0
    llf_count: int = 0

    def to_file(self) -> ScalingFile:
        return ScalingFile(hlf=HLFStats(mean=self.hlf_mean.tolist(), std=self.hlf_std.tolist(), count=self.hlf_count),
                           llf=LLFStats(mean=self.llf_mean.tolist(), std=self.llf_std.tolist(), count=self.llf_count))

    def save(self, path) -> Path:
        return write_json(path, self.to_file().model_dump())

    @classmethod
    def load(cls, path) -> "ScalingModel":
        """Read and validate a ``scaling.json``; BadInputError naming the file if it is not one."""
        try:
            f = ScalingFile.model_validate(read_json(path))
        except (ValidationError, ValueError, OSError) as e:
            raise BadInputError(f"{path}: not a valid scaling.json ({_first_error(e)})") from None
        return cls(np.asarray(f.hlf.mean, np.float64), np.asarray(f.hlf.std, np.float64),
                   np.asarray(f.llf.mean, np.float64), np.asarray(f.llf.std, np.float64),
                   f.hlf.count, f.llf.count)

    def transform_llf(self, llf: np.ndarray, n_particles: np.ndarray) -> np.ndarray:
        """(n, LLF_SIZE) flattened particle-major -> standardised; rows >= n_particles stay 0."""
        x = np.asarray(llf, np.float64).reshape(-1, N_PARTICLES, N_LLF_FEATURES)
        mask = np.arange(N_PARTICLES)[None, :] < np.asarray(n_particles)[:, None]
        y = np.where(mask[..., None], (x - self.llf_mean) / self.llf_std, 0.0)
        return y.reshape(-1, LLF_SIZE).astype(np.float32)


def _first_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        return f"{loc}: {err['msg']}" if loc else err["msg"]
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _fixed(col, width: int) -> np.ndarray:
    """Arrow list<float> column of equal-length rows -> (n, width) numpy."""
    import pyarrow as pa

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    vals = arr.flatten().to_numpy(zero_copy_only=False)
    return vals.reshape(len(arr), width) if len(arr) else np.zeros((0, width), np.float32)


def _real_particles(col, n_particles: np.ndarray) -> np.ndarray:
    """(sum n_particles, N_LLF_FEATURES) float64: each row's first ``n_particles`` particles of an
    LLF list column, whether it holds the real particles only (schema v3) or is padded to
    ``LLF_SIZE`` (v1, v2)."""
    import pyarrow as pa

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_fixed_size_list(arr.type):
        starts = (arr.offset + np.arange(len(arr), dtype=np.int64)) * arr.type.list_size
    else:
        starts = arr.offsets.to_numpy()[:-1].astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    width = np.asarray(n_particles, np.int64) * N_LLF_FEATURES
    pos = np.arange(int(width.sum())) - np.repeat(np.cumsum(width) - width, width)
    return values[np.repeat(starts, width) + pos].astype(np.float64).reshape(-1, N_LLF_FEATURES)


def row_moments(table, hlf_col: str = "hlf", llf_col: Optional[str] = "llf",
                n_col: str = "n_particles") -> tuple[Moments, Moments]:
    """The moments of the HLF and of the real LLF particles of the rows of an Arrow table (LLF
    empty when ``llf_col`` is None)."""
    h = Moments.of(_fixed(table.column(hlf_col), N_HLF))
    if not llf_col:
        return h, Moments.empty(N_LLF_FEATURES)
    return h, Moments.of(_real_particles(table.column(llf_col), table.column(n_col).to_numpy()))


def model_of(hlf: Moments, llf: Moments) -> ScalingModel:
    """The scaling model of these moments."""
    return ScalingModel(hlf.mean, hlf.std(), llf.mean, llf.std(), int(hlf.n), int(llf.n))


class FeatureScaler:
    """Estimator: ``fit(df)`` on a DataFrame with ``hlf`` and (optionally) ``llf``/``n_particles``."""

    def __init__(self, hlf_col: str = "hlf", llf_col: Optional[str] = "llf", n_col: str = "n_particles"):
        self.hlf_col, self.llf_col, self.n_col = hlf_col, llf_col, n_col

    def fit(self, df) -> ScalingModel:
        import pyarrow as pa
        from pyspark.sql.types import ArrayType, DoubleType, StringType, StructField, StructType

        hlf_col, llf_col, n_col = self.hlf_col, self.llf_col, self.n_col
        cols = [hlf_col] + ([llf_col, n_col] if llf_col else [])
        out_schema = StructType([StructField("what", StringType()), StructField("n", DoubleType()),
                                 StructField("mean", ArrayType(DoubleType())),
                                 StructField("m2", ArrayType(DoubleType()))])

        def partial(batches: Iterator):
            acc = {"hlf": Moments.empty(N_HLF), "llf": Moments.empty(N_LLF_FEATURES)}
            for b in batches:
                h, l_ = row_moments(pa.Table.from_batches([b]), hlf_col, llf_col, n_col)
                acc["hlf"], acc["llf"] = acc["hlf"].merge(h), acc["llf"].merge(l_)
            rows = [{"what": k, "n": m.n, "mean": m.mean.tolist(), "m2": m.m2.tolist()} for k, m in acc.items()]
            yield pa.RecordBatch.from_pylist(rows, schema=pa.schema([("what", pa.string()), ("n", pa.float64()),
                                                                     ("mean", pa.list_(pa.float64())),
                                                                     ("m2", pa.list_(pa.float64()))]))

        res = {"hlf": Moments.empty(N_HLF), "llf": Moments.empty(N_LLF_FEATURES)}
        for r in df.select(*cols).mapInArrow(spark_task(partial), out_schema).collect():
            res[r["what"]] = res[r["what"]].merge(Moments(r["n"], np.asarray(r["mean"]), np.asarray(r["m2"])))
        return model_of(res["hlf"], res["llf"])
