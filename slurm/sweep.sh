#!/bin/bash
# Submit one recipe under several override sets with the same seed, all in one W&B group: by default the
# three hpZ modes against plain ZeRO-3, i.e. the comparison the repository exists for.
#
#   slurm/sweep.sh [--group NAME] [--variants a,b] [--dry-run] [--no-check] [sbatch flags...] -- <recipe> [overrides...]
#
#   slurm/sweep.sh --nodes=4 --gpus-per-node=8 --ntasks-per-node=8 --time=4:00:00 -- llama2_7b_pretrain train.steps=500
#
#   --dry-run    print the sbatch commands, one shell-quoted line each (paste one to submit it), submit nothing;
#                after the same pre-flight check as a submission, so a printed command would be submitted
#   --no-check   skip the pre-flight check (every variant's config composes, its data and model directories exist,
#                as seen from this machine; skip it when only the compute nodes see them)
#
# Variants (edit VARIANTS below to add more):
#   zero3        zero.zero_hpz_partition_size=1                     plain ZeRO-3, the baseline
#   hpz-stock    zero.zero_hpz_partition_size=auto hpz.mode=stock   today's DeepSpeed minus its sync (racy)
#   hpz-sync     zero.zero_hpz_partition_size=auto hpz.mode=sync    host waits (DeepSpeed today)
#   hpz-ordered  zero.zero_hpz_partition_size=auto hpz.mode=ordered device-side ordering (ours)
#   hpz-legacy   zero.zero_hpz_partition_size=auto hpz.mode=legacy  DeepSpeed <= 0.13.4, the paper's baseline (racy);
#                                                                   not in the default set: --variants, or
#                                                                   scripts/paper_sweep.sh, which uses it
#
# One job per variant (a loop, not a job array: each variant keeps its own job name, log and requeue cycle,
# and one can be cancelled or resubmitted alone). Each run is named <group>-<variant> (its run directory and
# resume key), with wandb.group=<group> and wandb.name=<variant>. The seed is the recipe's (or a run.seed=...
# given among the common overrides), hence the same for every variant. Overrides after the recipe apply to all
# variants; a variant's own keys are given last, so they win.
set -euo pipefail

declare -A VARIANTS=(
  [zero3]="zero.zero_hpz_partition_size=1"
  [hpz-stock]="zero.zero_hpz_partition_size=auto hpz.mode=stock"
  [hpz-sync]="zero.zero_hpz_partition_size=auto hpz.mode=sync"
  [hpz-ordered]="zero.zero_hpz_partition_size=auto hpz.mode=ordered"
  [hpz-legacy]="zero.zero_hpz_partition_size=auto hpz.mode=legacy"
)
ORDER=(zero3 hpz-stock hpz-sync hpz-ordered)

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "sweep.sh: $*" >&2; exit 2; }

GROUP=""
SELECTED=""
DRY_RUN=0
CHECK=1
SBATCH_FLAGS=()
while [ $# -gt 0 ]; do
  case $1 in
    --group) GROUP=${2:?--group needs a name}; shift 2 ;;
    --group=*) GROUP=${1#--group=}; shift ;;
    --variants) SELECTED=${2:?--variants needs a list}; shift 2 ;;
    --variants=*) SELECTED=${1#--variants=}; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --no-check) CHECK=0; shift ;;
    -h | --help) usage ;;
    --) shift; break ;;
    *) SBATCH_FLAGS+=("$1"); shift ;;
  esac
done
[ $# -ge 1 ] || usage
RECIPE=$1
shift

if [ -n "$SELECTED" ]; then
  IFS=, read -r -a ORDER <<<"$SELECTED"
fi
for variant in "${ORDER[@]}"; do
  [ -n "${VARIANTS[$variant]+set}" ] || die "unknown variant '$variant' (known: ${!VARIANTS[*]})"
done
GROUP=${GROUP:-$(basename "$RECIPE" .yaml)-hpz-$(date +%Y%m%d-%H%M%S)}
# W&B group and run names become run directories and job names: keep them to safe characters.
[[ $GROUP =~ ^[A-Za-z0-9._-]+$ ]] || die "--group '$GROUP': use letters, digits, '.', '_', '-'"

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
# The recipe is checked even in a dry run (no Python needed): a wrong name would otherwise surface only when the
# first job starts, after waiting in the queue.
if ! { [[ $RECIPE == *.yaml || $RECIPE == *.yml ]] && [ -f "$RECIPE" ]; } && [ ! -f "$ROOT/recipes/$RECIPE.yaml" ]; then
  known=$(cd "$ROOT/recipes" && ls -- *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')
  die "no recipe '$RECIPE' (no recipes/$RECIPE.yaml). Recipes: ${known% }"
fi

# Each variant's train.sbatch arguments: the recipe, the common overrides, then the variant's own keys (given
# last, so they win), then its names. Kept shell-quoted (bash has no nested arrays); train_args unpacks one.
declare -A TRAIN_ARGS=()
for variant in "${ORDER[@]}"; do
  read -r -a variant_overrides <<<"${VARIANTS[$variant]}"
  TRAIN_ARGS[$variant]=$(printf '%q ' "$RECIPE" "$@" "${variant_overrides[@]}" \
    "run.name=$GROUP-$variant" "wandb.group=$GROUP" "wandb.name=$variant")
done
train_args() {  # $1: a variant -> the array TRAIN_ARGS_OUT
  eval "TRAIN_ARGS_OUT=(${TRAIN_ARGS[$1]})"
}

preflight() {
  # Every variant's arguments compose as train.py composes them, and the files they name exist (as seen from
  # this machine). One Python process for all variants: importing the config schema takes seconds.
  local python=${ZEROTRAIN_PYTHON:-$ROOT/.venv/bin/python} argv=() variant
  [ -x "$python" ] || python=python3
  for variant in "${ORDER[@]}"; do
    train_args "$variant"
    argv+=("$variant" "${#TRAIN_ARGS_OUT[@]}" "recipe=${TRAIN_ARGS_OUT[0]}" "${TRAIN_ARGS_OUT[@]:1}")
  done
  (cd "$ROOT" && "$python" - "${argv[@]}" <<'EOF'
import sys

from train import check_inputs
from zerotrain.errors import ZerotrainError
from zerotrain.run_config import parse_args

args, failed = sys.argv[1:], False
while args:
    variant, count = args[0], int(args[1])
    variant_args, args = args[2:2 + count], args[2 + count:]
    try:
        check_inputs(parse_args(variant_args))
    except ZerotrainError as e:
        print(f"sweep.sh: pre-flight check of variant {variant} failed (--no-check skips it): {e}", file=sys.stderr)
        failed = True
sys.exit(2 if failed else 0)
EOF
  )
}

if [ "$CHECK" = 1 ]; then  # a dry run too: it shows what would be submitted, and a bad key is not submitted
  preflight || die "nothing submitted"
fi
[ "$DRY_RUN" = 1 ] || mkdir -p logs  # sbatch cannot create the log directory; without it the job would fail silently

for variant in "${ORDER[@]}"; do
  train_args "$variant"
  cmd=(sbatch --parsable --job-name="$GROUP-$variant" "${SBATCH_FLAGS[@]}" "$HERE/train.sbatch" "${TRAIN_ARGS_OUT[@]}")
  if [ "$DRY_RUN" = 1 ]; then
    line=$(printf '%q ' "${cmd[@]}")  # a line a shell reads back as the same arguments: paste it to submit
    echo "${line% }"
  else
    echo "$variant: job $("${cmd[@]}")"
  fi
done
[ "$DRY_RUN" = 1 ] || echo "W&B group: $GROUP"
