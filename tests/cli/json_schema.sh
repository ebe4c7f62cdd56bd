#!/usr/bin/env bash
# Structured output checked by independent validators: kvq run --json-schema samples (hot, many
# seeds) from the story model under schemas of every supported keyword, and each complete
# document is validated by Python's jsonschema (python3-jsonschema, scripts/install-deps.sh);
# kvq run --regex and --grammar-file output is matched whole by Python's re.
set -u
source "$(dirname "$0")/common.bash"
require "$model"
python3 -c 'import jsonschema' 2>/dev/null || { echo "skip: python3 jsonschema not installed (scripts/install-deps.sh)"; exit 77; }

schemas=(
  '{"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}}, "required": ["name", "age"]}'
  '{"$defs": {"t": {"type": "object", "properties": {"v": {"type": "number"}, "k": {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 2}}, "required": ["v"]}}, "$ref": "#/$defs/t"}'
  '{"anyOf": [{"type": "null"}, {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": ["a", 1, null]}], "items": false, "minItems": 2}, {"const": {"k": [1, 2]}}]}'
  '{"type": "object", "properties": {"id": {"type": "integer"}}, "additionalProperties": {"type": ["boolean", "null"]}}'
  '{"type": "array", "items": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, "minItems": 1, "maxItems": 4}'
  '{"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}, "u": {"type": "string", "minLength": 2, "maxLength": 2}}, "required": ["s", "u"], "additionalProperties": false}'
  '{"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "exclusiveMaximum": 40, "multipleOf": 3}, "x": {"type": "number", "exclusiveMinimum": -0.5, "maximum": 2.25}, "d": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"}, "ip": {"format": "ipv4"}}, "required": ["n", "d", "id", "ip"]}'
  '{"properties": {"a": {"type": "string"}, "ab": {"type": "boolean"}}, "additionalProperties": {"type": "null"}, "required": ["ab"]}'
  '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "additionalProperties": {"type": "null"}, "minProperties": 2, "maxProperties": 3}'
  '{"$defs": {"c": {"enum": ["x", "y", "z", 1, null]}}, "type": "array", "items": {"$ref": "#/$defs/c"}, "uniqueItems": true, "minItems": 1}'
  '{"type": "object", "properties": {"id": {"type": "integer"}}, "patternProperties": {"^tag_[a-z]{1,4}$": {"type": "string", "maxLength": 5}, "[0-9]$": {"type": "null"}}, "additionalProperties": {"type": "boolean"}, "propertyNames": {"maxLength": 8}, "required": ["id"]}'
  '{"$defs": {"Color": {"enum": ["red", "green", "blue"], "type": "string"}}, "type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"$ref": "#/$defs/Color"}}'
  '{"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"], "allOf": [{"oneOf": [{"properties": {"kind": {"const": "a"}, "x": {"type": "integer", "minimum": 0}}, "required": ["x"]}, {"properties": {"kind": {"const": "b"}, "y": {"type": "boolean"}}}]}]}'
  '{"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"type": "string"}}, "required": ["id"], "additionalProperties": false}}, "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"tag": {"maxLength": 3}, "extra": {"type": "null"}}, "required": ["tag"]}]}'
  '{"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"}, "note": {"type": "string", "pattern": "(cat|dog)s?", "maxLength": 12}, "q": {"type": "string", "pattern": "^[^a-z]*\"\\\\.$", "maxLength": 10}}, "required": ["code", "note", "q"]}'
)
complete=0
invalid=0
for i in "${!schemas[@]}"; do
  printf '%s' "${schemas[$i]}" >"$tmp/schema$i.json"
  for seed in 1 2 3 4 5 6 7 8 9 10 11 12; do
    "$kvq" run -m "$model" -p "Once upon a time" -n 200 --temp 1.3 --seed "$seed" \
      --json-schema "$tmp/schema$i.json" >"$tmp/out" 2>"$tmp/err" || { echo "FAIL: schema $i seed $seed exited non-zero"; fails=$((fails + 1)); continue; }
    if grep -q 'no token continues' "$tmp/err"; then
      echo "FAIL: schema $i seed $seed: a dead end after $(head -c 300 "$tmp/out")"
      fails=$((fails + 1))
      continue
    fi
    grep -Eq 'stop: (end of the document|end of generation token)' "$tmp/err" || continue  # cut at -n
    complete=$((complete + 1))
    if ! python3 - "$tmp/schema$i.json" "$tmp/out" <<'PY'
import json, sys, jsonschema
schema = json.load(open(sys.argv[1]))
doc = json.loads(open(sys.argv[2], encoding="utf-8").read())
jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(doc)
PY
    then
      echo "FAIL: schema $i seed $seed: $(head -c 300 "$tmp/out")"
      invalid=$((invalid + 1))
    fi
  done
done
matched=0
for seed in 1 2 3 4 5 6 7 8; do
  pattern='(yes|no): [0-9]{1,3}( [a-z]+)?\.'
  "$kvq" run -m "$model" -p "Once upon a time" -n 60 --temp 1.3 --seed "$seed" --regex "$pattern" >"$tmp/out" 2>"$tmp/err" ||
    { echo "FAIL: --regex seed $seed exited non-zero"; fails=$((fails + 1)); continue; }
  grep -Eq 'stop: (end of the text|end of generation token)' "$tmp/err" || continue  # cut at -n
  if python3 - "$pattern" "$tmp/out" <<'PY'
import re, sys
text = open(sys.argv[2], encoding="utf-8").read()
assert text.endswith("\n")
sys.exit(0 if re.fullmatch(sys.argv[1], text[:-1]) else 1)
PY
  then matched=$((matched + 1)); else echo "FAIL: --regex seed $seed: $(head -c 200 "$tmp/out")"; invalid=$((invalid + 1)); fi
done
echo "--regex: $matched of 8 complete and matched"
check "--regex output matches" "[[ $matched -ge 6 ]]"
# A GBNF grammar (--grammar-file) and the regular expression of the same language.
printf '%s\n' 'root ::= item ("," " "? item){0,3} "."' 'item ::= [a-z]{1,6}   # a word' >"$tmp/list.gbnf"
matched=0
for seed in 1 2 3 4 5 6 7 8; do
  "$kvq" run -m "$model" -p "Once upon a time" -n 60 --temp 1.3 --seed "$seed" --grammar-file "$tmp/list.gbnf" >"$tmp/out" 2>"$tmp/err" ||
    { echo "FAIL: --grammar-file seed $seed exited non-zero"; fails=$((fails + 1)); continue; }
  grep -Eq 'stop: (end of the text|end of generation token)' "$tmp/err" || continue
  if python3 - '[a-z]{1,6}(, ?[a-z]{1,6}){0,3}\.' "$tmp/out" <<'PY'
import re, sys
text = open(sys.argv[2], encoding="utf-8").read()
sys.exit(0 if text.endswith("\n") and re.fullmatch(sys.argv[1], text[:-1]) else 1)
PY
  then matched=$((matched + 1)); else echo "FAIL: --grammar-file seed $seed: $(head -c 200 "$tmp/out")"; invalid=$((invalid + 1)); fi
done
echo "--grammar-file: $matched of 8 complete and matched"
check "--grammar-file output is a text of the grammar" "[[ $matched -ge 6 ]]"
echo "complete documents: $complete of $(( ${#schemas[@]} * 12 )), invalid: $invalid"
check "every complete document validates" "[[ $invalid -eq 0 ]]"
check "most runs complete their document" "[[ $complete -ge 64 ]]"
finish json_schema
