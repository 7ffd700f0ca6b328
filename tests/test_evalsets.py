"""The shipped evaluation sets: large enough, distinct within and across sets, non-empty, and loadable by name."""
import json

import pytest

from dpara_rt.evalsets import EVALSET_DIR, EVALSETS, evalset_records, load_evalset


@pytest.mark.parametrize("name", EVALSETS)
def test_each_set_has_at_least_40_distinct_non_empty_prompts_with_ids(name):
    prompts = load_evalset(name)
    assert len(prompts) >= 40
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    assert len(set(prompts)) == len(prompts)
    ids = [r["id"] for r in evalset_records(name)]
    assert len(set(ids)) == len(ids) and all(i.startswith(f"{name}-") for i in ids)
    lines = (EVALSET_DIR / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(ln)["prompt"] for ln in lines] == prompts  # one object per line, in file order


def test_no_prompt_appears_in_two_sets():
    seen = {}
    for name in EVALSETS:
        for p in load_evalset(name):
            key = " ".join(p.lower().split())
            assert key not in seen, f"{p[:60]!r} is in both {seen[key]} and {name}"
            seen[key] = name


def test_set_fields():
    assert all(r["lang"] for r in evalset_records("code"))
    assert sum(r["lang"] == "python" for r in evalset_records("code")) > len(evalset_records("code")) // 2
    assert all(r["answer"] for r in evalset_records("math"))
    assert {r["kind"] for r in evalset_records("chat")} == {"explain", "advice", "writing"}


def test_unknown_set_names_the_value_and_the_expected_ones():
    with pytest.raises(ValueError, match=r"'poetry'.*code, math, chat"):
        load_evalset("poetry")
