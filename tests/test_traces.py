"""Trace files with a row short of a field: the message says the line and the field."""
import pytest

from swa_ext.traces import TraceError, load_trace

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize("text, line, missing", [
    # A blank line before the short row: the reader skips it, the line number must not.
    (HEADER + "1.0,10,3\n\n2.0,20\n", 4, "GeneratedTokens"),
    (HEADER + "1.0\n", 2, "ContextTokens, GeneratedTokens"),
    # A quoted field spanning two lines: the row ends on line 4.
    (HEADER + '"1.0",10,3\n"2.0\n",20\n', 4, "GeneratedTokens"),
])
def test_a_csv_row_short_of_a_field_names_its_line_and_the_field(tmp_path, text, line, missing):
    path = tmp_path / "short.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:{line}: the row has no {missing} field ("), str(info.value)


def test_a_jsonl_record_names_the_keys_it_lacks(tmp_path):
    path = tmp_path / "short.jsonl"
    path.write_text('{"timestamp": 1, "input_length": 5, "output_length": 2}\n\n{"input_length": 5}\n')
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:3: the record has no timestamp, output_length"
