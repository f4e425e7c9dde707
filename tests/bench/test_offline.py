"""The offline benchmark's verdict on outputs reads as a result, not as a defect."""

from prefixcache.bench.offline import describe_output_match


def test_identical_outputs_are_reported_as_such():
    report = {"num_outputs": 16, "output_mismatches": 0, "dtype": "bfloat16"}
    assert describe_output_match(report) == "greedy outputs with and without the cache: identical (16 of 16)"


def test_bfloat16_differences_are_explained():
    text = describe_output_match({"num_outputs": 16, "output_mismatches": 2, "dtype": "bfloat16"})
    assert "14 of 16 identical; 2 differ" in text and "bfloat16 rounds" in text and "False" not in text


def test_float32_differences_are_flagged_as_unexpected():
    text = describe_output_match({"num_outputs": 16, "output_mismatches": 1, "dtype": "float32"})
    assert "1 of 16 DIFFER (unexpected in float32)" in text
