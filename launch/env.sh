# Sourced by the launch scripts.  torch JIT-builds DeepSpeed's CPU comm extension under TORCH_EXTENSIONS_DIR;
# its default (~/.cache/torch_extensions) is shared by every environment, while the build key holds the
# environment's path, so two checkouts rebuild it for each other.  Unless set: a folder of this venv.
if [[ -z "${TORCH_EXTENSIONS_DIR:-}" ]]; then
    venv_dir=$(python -c 'from ds_packdpo.run.build_lock import venv_extensions_dir as d; print(d() or "")')
    if [[ -n "$venv_dir" ]]; then
        export TORCH_EXTENSIONS_DIR=$venv_dir
    fi
fi

# What the ranks on other nodes need of the launching shell, besides what their launcher passes on: this venv's tools
# first on PATH (ninja builds that extension), where the extension and the hub cache are, the accelerator.
# launch/mpirun.sh passes them with -x, launch/multinode.sh through DeepSpeed's environment file.
JOB_ENV=(PATH LD_LIBRARY_PATH DS_ACCELERATOR HF_HOME TORCH_EXTENSIONS_DIR)
