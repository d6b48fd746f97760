"""Specs are validated on load: a malformed spec names its file and field."""
from __future__ import annotations

import pytest

from verify.model.specs import SpecError, load_spec, parse_spec

GOOD = '''op = "x"
derivation = "the reference rounds once to bf16 after an fp32 sum over K; k=2 covers another order"
[outputs.y]
class = "derived"
k = 2.0
floor_ulps = 1.0
'''


def test_good_spec_parses():
    spec = parse_spec(GOOD, "x.toml")
    assert spec.output("y").k == 2.0 and spec.claims.deterministic


@pytest.mark.parametrize("mutate,field", [
    (lambda s: s.replace('derivation = "the', 'derivation = "x"\n#'), "derivation"),
    (lambda s: s.replace('"derived"', '"fuzzy"'), "outputs.y.class"),
    (lambda s: s.replace("k = 2.0\n", ""), "outputs.y"),
    (lambda s: s.replace('class = "derived"', 'class = "bitwise"'), "outputs.y"),
    (lambda s: s + "tolerance = 3\n", "tolerance"),
    (lambda s: s.replace("k = 2.0", "k = 0.5"), "outputs.y.k"),
    (lambda s: s.replace("[outputs.y]", "[outputs.y"), "not valid TOML"),
    (lambda s: s.replace("floor_ulps = 1.0", "floor_ulps = 1.0\nscore_k = 4.0"), "outputs.y"),   # tie_aware_ids only
    (lambda s: s + '[outputs.ids]\nclass = "tie_aware_ids"\nscore_k = 0.5\n', "outputs.ids.score_k"),
])
def test_malformed_spec_names_the_field(mutate, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.")) as e:
        parse_spec(mutate(GOOD), "x.toml")
    assert "x.toml" in str(e.value) and "\n" not in str(e.value)


def test_missing_spec_says_where_to_create_it(tmp_path):
    with pytest.raises(SpecError, match="create .*nope.toml"):
        load_spec("nope", tmp_path)


def test_spec_op_must_match_file(tmp_path):
    (tmp_path / "z.toml").write_text(GOOD)
    with pytest.raises(SpecError, match="does not match the file name"):
        load_spec("z", tmp_path)


def test_per_dtype_bounds_override_only_their_dtype():
    spec = parse_spec(GOOD + "by_dtype.float32 = { k = 3.0, floor_ulps = 16.0 }\n", "x.toml")
    assert spec.output("y").bounds("float32") == (3.0, 16.0)
    assert spec.output("y").bounds("bfloat16") == (2.0, 1.0)
    with pytest.raises(SpecError, match="by_dtype"):
        parse_spec(GOOD + "by_dtype.int8 = { k = 3.0, floor_ulps = 16.0 }\n", "x.toml")
