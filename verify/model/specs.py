"""Tolerance specs: tolerance_specs/<op>.toml, validated on load (pydantic), with a mandatory derivation."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

SPEC_DIR = Path(__file__).resolve().parents[2] / "tolerance_specs"


class SpecError(ValueError):
    """A spec file is missing or malformed; the message names the file and the field."""


class DtypeBounds(BaseModel):
    """k and floor for one working dtype, where the derivation differs (e.g. fp32, whose outputs carry
    no dominant final rounding); the derivation text must say why."""
    model_config = ConfigDict(extra="forbid")
    k: float = Field(ge=1.0, le=64.0)
    floor_ulps: float = Field(ge=0.0, le=64.0)
    element_floor: float | None = Field(default=None, gt=0.0, le=1.0)


class OutputSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    klass: Literal["bitwise", "derived", "tie_aware_ids"] = Field(alias="class")
    k: float | None = Field(default=None, ge=1.0, le=64.0)
    floor_ulps: float | None = Field(default=None, ge=0.0, le=64.0)
    by_dtype: dict[Literal["bfloat16", "float16", "float32"], DtypeBounds] = Field(default_factory=dict)
    # every element also judged on its own scale, down to element_floor x its row's (compare.
    # compare_derived); the derivation must bound a correct kernel's error at an element by that scale
    element_floor: float | None = Field(default=None, gt=0.0, le=1.0)
    # tie_aware_ids: how many times the baseline's own score error a correct candidate's scores may err
    # by (1: the selection is the op itself; a whole layer's router sees its input within the layer's k);
    # the tie band is that many times the baseline's (compare.tie_band). The derivation must bound it.
    score_k: float | None = Field(default=None, ge=1.0, le=64.0)

    @model_validator(mode="after")
    def _derived_needs_bounds(self):
        if self.klass == "derived" and (self.k is None or self.floor_ulps is None):
            raise ValueError("class 'derived' needs both k and floor_ulps")
        if self.klass != "derived" and (self.k is not None or self.floor_ulps is not None or self.by_dtype
                                        or self.element_floor is not None):
            raise ValueError(f"class {self.klass!r} takes no k, floor_ulps, by_dtype or element_floor")
        if self.klass != "tie_aware_ids" and self.score_k is not None:
            raise ValueError(f"class {self.klass!r} takes no score_k (tie_aware_ids only)")
        return self

    def bounds(self, dtype) -> tuple[float, float]:
        """(k, floor_ulps) for an output of this working dtype (a torch.dtype or its name)."""
        name = str(dtype).removeprefix("torch.")
        b = self.by_dtype.get(name)
        return (b.k, b.floor_ulps) if b else (self.k, self.floor_ulps)

    def element_floor_for(self, dtype) -> float | None:
        """element_floor for this working dtype: by_dtype's where it names the dtype (None there: row only)."""
        b = self.by_dtype.get(str(dtype).removeprefix("torch."))
        return b.element_floor if b else self.element_floor


class Claims(BaseModel):
    model_config = ConfigDict(extra="forbid")
    deterministic: bool = True
    batch_invariant: bool = True
    reduction_order: str | None = None


class Waiver(BaseModel):
    model_config = ConfigDict(extra="forbid")
    candidate: str
    match: dict[str, str | int | float] = Field(default_factory=dict)
    reason: str = Field(min_length=10)
    expected_error: str = Field(min_length=3)

    def applies(self, candidate: str, case) -> bool:
        if self.candidate != candidate:
            return False
        return all(str(getattr(case, key, case.knob(key))) == str(val) for key, val in self.match.items())


class ToleranceSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    op: str
    derivation: str = Field(min_length=40)
    claims: Claims = Field(default_factory=Claims)
    outputs: dict[str, OutputSpec]
    waivers: list[Waiver] = Field(default_factory=list)

    @field_validator("outputs")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("at least one [outputs.<name>] table is required")
        return v

    def output(self, name: str) -> OutputSpec:
        try:
            return self.outputs[name]
        except KeyError:
            raise SpecError(f"spec for op {self.op!r} has no [outputs.{name}] table; add one") from None


def parse_spec(text: str, source: str) -> ToleranceSpec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{source}: not valid TOML: {e}") from None
    try:
        return ToleranceSpec.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise SpecError(f"{source}: field {where}: {first['msg']} ({e.error_count()} problem(s))") from None


@functools.lru_cache(maxsize=None)
def load_spec(op: str, spec_dir: Path = SPEC_DIR) -> ToleranceSpec:
    path = Path(spec_dir) / f"{op}.toml"
    if not path.exists():
        raise SpecError(f"op {op!r} has no spec: create {path}")
    spec = parse_spec(path.read_text(), str(path))
    if spec.op != op:
        raise SpecError(f"{path}: field op = {spec.op!r} does not match the file name {op!r}")
    return spec
