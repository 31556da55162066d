#!/usr/bin/env bash
# Jordan-RoPE section 5.7's norm-profile claim at CPU scale (docs/results/lm-corpora.md, "Section
# 5.7"): the MusicNet winner, Scaled-exact m=3 c=.5 eta0=.1, trained on MusicNet MIDI tokens
# (`relpos reproduce jordan-t7 --scale cpu`, 3 seeds), then each seed's positioned query/key norm
# profile over 2048 tokens (`relpos eval --profiles`) and its learned gamma / |eta| means. Prints
# one row per seed and layer: key norm at 2047 over position 0 (the paper: about 206x), query
# norm likewise (the paper: about 1%), the same over the mean of the first and last 16
# positions, and writes OUT/norm_profiles.csv and FIGURES/jordan-t7-norm-profiles.png.
#
#   bash scripts/norm_profiles.sh
#
# Environment: RELPOS (default build/relpos), OUT (default runs/reproduce/jordan-t7-cpu, where
# reproduce writes; finished runs are reused), FIGURES (default docs/results/figures).
set -euo pipefail
cd "$(dirname "$0")/.."
RELPOS=${RELPOS:-build/relpos}
OUT=${OUT:-runs/reproduce/jordan-t7-cpu}
FIGURES=${FIGURES:-docs/results/figures}
METHOD="Exact m=3 c=.5 eta0=.1"
RUN=jordan_m_3_regime_scaled_c_0.5_eta0_0.1_eta_max_1_L_256_direction_paper
export OMP_NUM_THREADS=1
"$RELPOS" reproduce jordan-t7 --scale cpu --methods "$METHOD" --set threads=1 --out "$OUT" 2>&1 |
  grep -v '^relpos: warning:'  # (the MIDI files' tokeniser warnings)
summary="$OUT/norm_profiles.csv"
echo "seed,layer,k_end_over_start,q_end_over_start,k_last16_over_first16,q_last16_over_first16,mean_gamma,mean_abs_eta" \
  >"$summary.tmp"
for s in 0 1 2; do
  profile="$OUT/$RUN/s$s/profile_2048.csv"
  params=$("$RELPOS" eval --checkpoint "$OUT/$RUN/s$s" --lengths 2048 --profiles "$profile" 2>/dev/null |
    sed -n 's/^mechanism per layer (mean gamma, |eta|, |gates|): //p')
  awk -F, -v seed="$s" -v params="$params" '
    NR == 1 { next }
    { n[$1]++; q[$1, n[$1]] = $3; k[$1, n[$1]] = $4 }
    END {
      for (layer = 0; (layer "") in n; layer++) {
        m = n[layer]; qa = qb = ka = kb = 0
        for (i = 1; i <= 16; i++) { qa += q[layer, i]; ka += k[layer, i] }
        for (i = m - 15; i <= m; i++) { qb += q[layer, i]; kb += k[layer, i] }
        # this layer'"'"'s entry of the JSON list the eval prints: {"abs_eta":..,"abs_gates":..,"gamma":..}
        rest = params; for (j = 0; j < layer; j++) sub(/^[^}]*}/, "", rest)
        match(rest, /"gamma":[-0-9.e]+/); g = substr(rest, RSTART + 8, RLENGTH - 8)
        match(rest, /"abs_eta":[-0-9.e]+/); e = substr(rest, RSTART + 10, RLENGTH - 10)
        printf "%s,%d,%.1f,%.4f,%.1f,%.4f,%.5f,%.4f\n", seed, layer, k[layer, m] / k[layer, 1],
          q[layer, m] / q[layer, 1], kb / ka, qb / qa, g, e
      }
    }' "$profile" >>"$summary.tmp"
done
mv "$summary.tmp" "$summary"
column -s, -t "$summary"
mkdir -p "$FIGURES"
gnuplot <<EOF
set terminal pngcairo size 900,520
set output "$FIGURES/jordan-t7-norm-profiles.png.tmp"
set datafile separator ","
set logscale y
set xrange [0:2047]
set key top left
set xlabel "position"
set ylabel "norm of the positioned vector"
set title "Jordan-RoPE Exact m=3 c=.5 eta0=.1 on MusicNet MIDI (CPU scale, seed 0)"
plot "$OUT/$RUN/s0/profile_2048.csv" every ::1 using (\$1 == 0 ? \$2 : 1/0):4 with lines title "key, layer 0", \
     "" every ::1 using (\$1 == 0 ? \$2 : 1/0):3 with lines title "query, layer 0", \
     "" every ::1 using (\$1 == 1 ? \$2 : 1/0):4 with lines title "key, layer 1", \
     "" every ::1 using (\$1 == 1 ? \$2 : 1/0):3 with lines title "query, layer 1"
EOF
mv "$FIGURES/jordan-t7-norm-profiles.png.tmp" "$FIGURES/jordan-t7-norm-profiles.png"
echo "-> $summary, $FIGURES/jordan-t7-norm-profiles.png"
