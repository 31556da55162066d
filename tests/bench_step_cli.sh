#!/usr/bin/env bash
# `relpos-train bench-step` on a tiny model: one row per (mechanism, attention), the ratios against
# both SDPA models filled in, and sdpa_table refusing a transform it cannot tabulate by name (exit 2).
# Usage: tests/bench_step_cli.sh RELPOS_TRAIN
set -euo pipefail
bin=$1
fail() { echo "bench_step_cli: $*" >&2; exit 1; }
small=(--layers 1 --d-model 16 --heads 2 --vocab 7 --T 16 --batch 1 --rounds 2 --threads 1 --layout half_split)
md=$("$bin" bench-step "${small[@]}" --mechanisms rope --attention fused sdpa sdpa_table)
for want in "/ half_split pairs," "| vs sdpa (per round) | vs sdpa_table (per round) |" "| rope | fused |" \
            "| rope | sdpa |" "| rope | sdpa_table |"; do
  grep -qF -- "$want" <<<"$md" || fail "output lacks '$want'"
done
row=$(grep -F "| rope | fused |" <<<"$md")
[ "$(grep -oE '\| [0-9]+\.[0-9]{3} \([0-9]+\.[0-9]{3}\) ' <<<"$row" | wc -l)" -eq 2 ] ||
  fail "the fused row lacks a ratio against each SDPA model: $row"
set +e
err=$("$bin" bench-step "${small[@]}" --mechanisms 'jordan(m=2)' --attention sdpa_table 2>&1)
rc=$?
set -e
[ "$rc" -eq 2 ] || fail "a learned transform under sdpa_table exited $rc, not 2: $err"
grep -qF "sdpa_table" <<<"$err" || fail "the refusal does not name sdpa_table: $err"
echo "bench_step_cli: ok"
