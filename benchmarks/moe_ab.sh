#!/usr/bin/env bash
# A/B of the fused MoE kernels on this GPU, back to back: benchmarks/moe_layer.py at a baseline
# commit (checked out into a temporary git worktree) and then at the working tree, with the same
# arguments. Writes base.json and new.json into $OUT (default: the current directory).
#   bash benchmarks/moe_ab.sh BASE_REV [moe_layer.py arguments]
#   bash benchmarks/moe_ab.sh fab8390 --model qwen3-30b-a3b --tokens 1,8,16,64 --calls 16
set -euo pipefail
base=$1
shift
root=$(git rev-parse --show-toplevel)
out=$(cd "${OUT:-.}" && pwd)
dir=$(mktemp -d)
git -C "$root" worktree add -f --detach "$dir/base" "$base" > /dev/null
trap 'git -C "$root" worktree remove --force "$dir/base"; rm -rf "$dir"' EXIT
for side in base new; do
    src=$root
    [ "$side" = base ] && src=$dir/base
    dirty=""
    [ "$side" = new ] && ! git -C "$root" diff --quiet HEAD && dirty=" + uncommitted changes"
    echo "== $side: $(git -C "$src" rev-parse --short HEAD)$dirty"
    (cd "$src/benchmarks" && PYTHONPATH="$src" python moe_layer.py "$@" --json "$out/$side.json")
done
