# Sourced by the launch scripts.  torch JIT-builds DeepSpeed's CPU comm extension under TORCH_EXTENSIONS_DIR;
# its default (~/.cache/torch_extensions) is shared by every environment, while the build key holds the
# environment's path, so two checkouts rebuild it for each other.  Unless set: a folder of this venv.
if [[ -z "${TORCH_EXTENSIONS_DIR:-}" ]]; then
    venv_dir=$(python -c 'from ds_packdpo.run.build_lock import venv_extensions_dir as d; print(d() or "")')
    if [[ -n "$venv_dir" ]]; then
        export TORCH_EXTENSIONS_DIR=$venv_dir
    fi
fi
