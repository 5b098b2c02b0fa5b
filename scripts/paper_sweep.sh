#!/bin/bash
# Submit the paper's comparison for one model on SLURM (docs/paper.md): plain ZeRO-3 and hpZ legacy / sync /
# ordered, four jobs with the same recipe, seed and data, in one W&B group. The racy baseline is `legacy`
# (hpz.mode=legacy: DeepSpeed <= 0.13.4, the version whose failure the paper reports), not `stock` (today's
# DeepSpeed minus its sync: the race alone, without 0.13's copy rule); --variants adds hpz-stock if wanted.
#
#   scripts/paper_sweep.sh [--dry-run] [--no-check] [--group NAME] [--nodes N] [--variants a,b]
#                          [sbatch flags...] <model> [key=value overrides...]
#
#   models: llama2_7b llama2_7b_mmlu llama2_13b llama2_70b falcon_7b falcon_40b   (recipes/paper_<model>.yaml)
#
#   scripts/paper_sweep.sh llama2_7b
#   scripts/paper_sweep.sh --group paper-7b-try2 --time=12:00:00 --partition=a100 llama2_7b \
#       model.pretrained_path=/models/Llama-2-7b-hf data.train.0.path=/data/prepared/chat
#
# It runs slurm/sweep.sh (one job per variant: run.name=<group>-<variant>, wandb.group=<group>,
# wandb.name=<variant>) with --nodes (default: per model, below), --gpus-per-node=8 and --ntasks-per-node=8;
# other sbatch flags (--time, --partition, --account, ...) pass through and win over those defaults.
#   --group NAME   the W&B group and run-name prefix (default paper-<model>-<date-time>). Reusing a group resumes
#                  its runs (same run directories) instead of starting new ones.
#   --variants     a subset of zero3,hpz-legacy,hpz-sync,hpz-ordered (default: all four), or hpz-stock
#   --dry-run      print the sbatch commands (one shell-quoted line each) and submit nothing (after the check)
#   --no-check     skip the pre-flight check (config, checkpoint and data directories, from this machine)
# Afterwards: python -m tools.compare --group <group> --project zerotrain-paper --baseline hpz-legacy
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

declare -A DEFAULT_NODES=(  # our choice, not the paper's: enough 80 GB A100s for the shards (docs/paper.md)
  [llama2_7b]=2
  [llama2_7b_mmlu]=2  # the same on MMLU's auxiliary-train questions (recipes/paper_llama2_7b_mmlu.yaml)
  [llama2_13b]=2
  [llama2_70b]=8
  [falcon_7b]=2
  [falcon_40b]=4
)

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "paper_sweep.sh: $*" >&2; exit 2; }

# The paper's comparison: its racy baseline is DeepSpeed <= 0.13.4, i.e. hpz.mode=legacy (docs/paper.md).
PAPER_VARIANTS=zero3,hpz-legacy,hpz-sync,hpz-ordered

DRY_RUN=0
CHECK=1
GROUP=""
NODES=""
VARIANTS=""
SBATCH_FLAGS=()
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY_RUN=1; shift ;;
    --no-check) CHECK=0; shift ;;
    --group) GROUP=${2:?--group needs a name}; shift 2 ;;
    --group=*) GROUP=${1#--group=}; shift ;;
    --nodes | -N) NODES=${2:?$1 needs a count}; shift 2 ;;
    --nodes=*) NODES=${1#--nodes=}; shift ;;
    --variants) VARIANTS=${2:?--variants needs a list}; shift 2 ;;
    --variants=*) VARIANTS=${1#--variants=}; shift ;;
    -h | --help) usage ;;
    --) shift; break ;;
    -*) SBATCH_FLAGS+=("$1"); shift ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || usage
GIVEN=$1
shift
MODEL=${GIVEN//-/_}
MODEL=${MODEL#paper_}
[ -n "${DEFAULT_NODES[$MODEL]+set}" ] \
  || die "unknown model '$GIVEN'. Models: llama2_7b llama2_7b_mmlu llama2_13b llama2_70b falcon_7b falcon_40b (recipes/paper_<model>.yaml)"
RECIPE=paper_$MODEL
[ -f "$ROOT/recipes/$RECIPE.yaml" ] || die "no recipes/$RECIPE.yaml"
NODES=${NODES:-${DEFAULT_NODES[$MODEL]}}
GROUP=${GROUP:-paper-${MODEL//_/-}-$(date +%Y%m%d-%H%M%S)}
[ -x "$ROOT/slurm/sweep.sh" ] || [ -f "$ROOT/slurm/sweep.sh" ] || die "slurm/sweep.sh is missing"

SWEEP=(bash "$ROOT/slurm/sweep.sh" --group "$GROUP" --variants "${VARIANTS:-$PAPER_VARIANTS}")
[ "$DRY_RUN" = 0 ] || SWEEP+=(--dry-run)
# sweep.sh runs the pre-flight check (each variant's config composes; checkpoint and data directories exist, as
# seen from this machine) before it submits anything.
[ "$CHECK" = 1 ] || SWEEP+=(--no-check)
SWEEP+=(--nodes="$NODES" --gpus-per-node=8 --ntasks-per-node=8 "${SBATCH_FLAGS[@]}" -- "$RECIPE" "$@")

if [ "$DRY_RUN" = 1 ]; then
  exec "${SWEEP[@]}"  # one shell-quoted sbatch command per line
fi
# slurm/sweep.sh resolves train.sbatch itself; the jobs run from the submit directory, i.e. the repository.
cd "$ROOT"
"${SWEEP[@]}"
echo "compare: python -m tools.compare --group $GROUP --project zerotrain-paper --baseline hpz-legacy" \
     "(or --runs-root runs for the local run directories)"
