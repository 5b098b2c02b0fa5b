#!/bin/bash
# Submit one recipe under several override sets with the same seed, all in one W&B group: by default the
# three hpZ modes against plain ZeRO-3, i.e. the comparison the repository exists for.
#
#   slurm/sweep.sh [--group NAME] [--variants a,b] [--dry-run] [sbatch flags...] -- <recipe> [overrides...]
#
#   slurm/sweep.sh --nodes=4 --gpus-per-node=8 --ntasks-per-node=8 --time=4:00:00 -- llama2_7b train.steps=500
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

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

GROUP=""
SELECTED=""
DRY_RUN=0
SBATCH_FLAGS=()
while [ $# -gt 0 ]; do
  case $1 in
    --group) GROUP=${2:?--group needs a name}; shift 2 ;;
    --group=*) GROUP=${1#--group=}; shift ;;
    --variants) SELECTED=${2:?--variants needs a list}; shift 2 ;;
    --variants=*) SELECTED=${1#--variants=}; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
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
  [ -n "${VARIANTS[$variant]+set}" ] || { echo "unknown variant '$variant' (known: ${!VARIANTS[*]})" >&2; exit 2; }
done
GROUP=${GROUP:-$(basename "$RECIPE" .yaml)-hpz-$(date +%Y%m%d-%H%M%S)}
# W&B group and run names become run directories and job names: keep them to safe characters.
[[ $GROUP =~ ^[A-Za-z0-9._-]+$ ]] || { echo "--group '$GROUP': use letters, digits, '.', '_', '-'" >&2; exit 2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ "$DRY_RUN" = 1 ] || mkdir -p logs  # sbatch cannot create the log directory; without it the job would fail silently

for variant in "${ORDER[@]}"; do
  read -r -a variant_overrides <<<"${VARIANTS[$variant]}"
  cmd=(
    sbatch --parsable --job-name="$GROUP-$variant" "${SBATCH_FLAGS[@]}"
    "$HERE/train.sbatch" "$RECIPE" "$@" "${variant_overrides[@]}"
    "run.name=$GROUP-$variant" "wandb.group=$GROUP" "wandb.name=$variant"
  )
  if [ "$DRY_RUN" = 1 ]; then
    printf '%s\0' "${cmd[@]}"
    printf '\n'
  else
    echo "$variant: job $("${cmd[@]}")"
  fi
done
[ "$DRY_RUN" = 1 ] || echo "W&B group: $GROUP"
