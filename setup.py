"""Build shardkit's C++/CUDA extension, `shardkit._C`. The package's metadata is in pyproject.toml.

A CUDA build (adding the kernels in csrc/cuda/ and the NCCL code in csrc/comm/nccl/) when the installed torch
is a CUDA build and a CUDA toolkit is found at CUDA_HOME, else a CPU build. SHARDKIT_CUDA=1 demands CUDA (an
error if it cannot be built, never a silent CPU build); SHARDKIT_CUDA=0 forces the CPU build. Install with
`pip install --no-build-isolation .` so the extension is built against the torch already installed.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import setuptools
from setuptools import find_packages, setup

# pyproject.toml's `license = "BSD-3-Clause"` (an SPDX expression) and `license-files` need setuptools 77. With
# --no-build-isolation pip builds with whatever setuptools the environment has (a Python 3.11 venv starts with
# 65.5, which torch's `setuptools<82` keeps) and does not check pyproject's build requirements: say so here,
# rather than let an older setuptools fail on the license field.
if int(setuptools.__version__.split(".")[0]) < 77:
    raise SystemExit(f"shardkit's build needs setuptools >= 77 (this environment has {setuptools.__version__}): "
                     "pip install 'setuptools>=77' wheel, then build again with --no-build-isolation")

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"
# Folders whose sources every build compiles; the CUDA build adds CUDA_FOLDERS.
CPU_FOLDERS = ["core", "comm", "ddp", "fsdp", "compress"]
CUDA_FOLDERS = ["cuda", "comm/nccl"]


def _sources(folder: str, patterns: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    for pattern in patterns:
        found += glob.glob(str(CSRC / folder / pattern))
    return sorted(os.path.relpath(path, ROOT) for path in found)


def _want_cuda() -> bool:
    """Decide CPU vs CUDA; raise if CUDA is demanded but impossible."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    setting = os.environ.get("SHARDKIT_CUDA", "").strip()
    if setting not in ("", "0", "1"):
        raise RuntimeError(f"SHARDKIT_CUDA must be 0 or 1, got {setting!r}")
    toolkit = CUDA_HOME is not None and (Path(CUDA_HOME) / "include" / "cuda_runtime.h").exists()
    possible = torch.version.cuda is not None and toolkit
    if setting == "1" and not possible:
        if torch.version.cuda is None:
            why = "torch is a CPU build"
        else:
            why = f"no CUDA toolkit at CUDA_HOME={CUDA_HOME!r} (need include/cuda_runtime.h); set CUDA_HOME"
        raise RuntimeError(f"SHARDKIT_CUDA=1 asks for the CUDA extension, but it cannot be built: {why}")
    if setting == "0":
        return False
    return possible


def _shared_libstdcxx_link_args() -> list[str]:
    """Link arguments that keep a static copy of libstdc++ out of `_C`, where the compiler would put one there.

    A compiler that has only a static libstdc++ (seen: a GCC under /opt/gcc on a GPU machine's image) copies
    the C++ runtime into _C.so. The process then holds two runtimes, torch's and _C's, and they disagree on
    locale facets: the first error message that formats a number crashed the process instead of raising. Naming
    the libstdc++.so.6 torch itself runs with on the link line binds every std:: symbol to it; nothing is copied
    (seen there: no std:: symbol defined in _C.so). A symbol only a newer static libstdc++ has would still be
    copied in; the compiler's own shared libstdc++, where it has one, is always preferred.
    """
    import shlex
    import subprocess
    import sysconfig

    import torch  # noqa: F401  (maps the libstdc++ torch runs with into this process)

    # The compiler setuptools links C++ extensions with: $CXX, else the one Python was configured with.
    cxx = shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++")
    try:
        found = subprocess.run(cxx + ["-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return []  # the build itself will say what is wrong with the compiler
    if os.path.isabs(found) and os.path.exists(found):
        return []  # the compiler links its shared libstdc++, as usual
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            loaded = {line.split()[5] for line in maps if "/libstdc++.so" in line and len(line.split()) >= 6}
    except OSError:
        loaded = set()
    if len(loaded) != 1:
        raise RuntimeError(f"shardkit: the compiler {cxx[0]} has no shared libstdc++ (it would copy one into the "
                           f"extension, which crashes next to torch's), and torch's could not be found to link "
                           f"instead (mapped: {sorted(loaded)}); build with a compiler that has one (CXX=...)")
    return [loaded.pop()]


def _nccl_paths() -> tuple[str, str]:
    """Include and library folders of NCCL: the nvidia-nccl wheel torch depends on, else CUDA_HOME."""
    from torch.utils.cpp_extension import CUDA_HOME

    candidates: list[Path] = []
    try:
        import nvidia.nccl  # type: ignore[import-not-found]

        candidates += [Path(p) for p in nvidia.nccl.__path__]
    except ImportError:
        pass
    if os.environ.get("NCCL_HOME"):
        candidates.append(Path(os.environ["NCCL_HOME"]))
    if CUDA_HOME:
        candidates.append(Path(CUDA_HOME))
    for base in candidates:
        if (base / "include" / "nccl.h").exists():
            for lib in ("lib", "lib64"):
                if glob.glob(str(base / lib / "libnccl.so*")):
                    return str(base / "include"), str(base / lib)
    raise RuntimeError(
        "shardkit's CUDA build needs NCCL (nccl.h and libnccl.so): install the nvidia-nccl wheel that "
        f"your torch depends on, or set NCCL_HOME. Looked in: {[str(c) for c in candidates]}"
    )


def get_extensions():
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: F401

    cuda = _want_cuda()
    sources = ["csrc/bindings.cpp"]
    for folder in CPU_FOLDERS:
        sources += _sources(folder, ("*.cpp",))
    # No -std flag: torch's cpp_extension picks the standard its headers need (C++17 for 2.11-2.13,
    # C++20 for 2.14). csrc/core stays plain C++17 so the GoogleTest build needs no torch.
    # -g0: no debug info (Python's own CFLAGS, which torch's build passes on, carry -g): a 4x smaller _C.so and
    # a faster build. SHARDKIT_DEBUG=1 keeps it, for gdb.
    debug = os.environ.get("SHARDKIT_DEBUG", "").strip() == "1"
    cxx_flags = ["-O3", "-fvisibility=hidden"] + ([] if debug else ["-g0"])
    define_macros = []
    include_dirs = [str(CSRC)]
    library_dirs: list[str] = []
    libraries = ["rt"]
    extra_link_args: list[str] = _shared_libstdcxx_link_args()
    if not cuda:
        return [
            CppExtension(
                "shardkit._C",
                sources,
                include_dirs=include_dirs,
                define_macros=define_macros,
                extra_compile_args={"cxx": cxx_flags},
                libraries=libraries,
                extra_link_args=extra_link_args,
            )
        ]
    for folder in CUDA_FOLDERS:
        sources += _sources(folder, ("*.cpp", "*.cu"))
    nccl_include, nccl_lib = _nccl_paths()
    include_dirs.append(nccl_include)
    library_dirs.append(nccl_lib)
    # The wheel ships only the versioned soname; link it by file name and find it again at run time.
    nccl_so = sorted(glob.glob(os.path.join(nccl_lib, "libnccl.so*")))[0]
    extra_link_args += [f"-l:{os.path.basename(nccl_so)}", f"-Wl,-rpath,{nccl_lib}"]
    define_macros.append(("SHARDKIT_WITH_CUDA", "1"))
    return [
        CUDAExtension(
            "shardkit._C",
            sources,
            include_dirs=include_dirs,
            library_dirs=library_dirs,
            libraries=libraries,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
            extra_link_args=extra_link_args,
        )
    ]


class _PrecompiledTorchHeaders:
    """csrc/precompiled.h compiled once as a GCC precompiled header, then force-included (``-include``) into every
    C++ source of the extension outside csrc/core/ (which includes no torch header): each source would otherwise
    parse the same ~20 s of torch headers (c10d, ATen) again, most of a 2-core machine's build of the extension
    (measured: backend.cpp 35 s -> 11 s of CPU).

    Installed around torch's ninja step, where torch has composed the exact flags every source compiles with; the
    header is compiled with those same flags (a GCC precompiled header is used only under the flags it was made
    with). It is remade only when the compiler, the flags, the header or torch change (its key file), so an
    incremental build recompiles nothing because of it. Nothing depends on it for correctness: for another
    compiler than GCC, with SHARDKIT_PCH=0, or if making it fails (a warning says why), the build goes on without
    it, and where GCC finds it unusable it reads csrc/precompiled.h itself. nvcc's sources never see it.
    """

    HEADER = CSRC / "precompiled.h"

    def __init__(self, build_temp: str) -> None:
        self.folder = Path(build_temp) / "precompiled"

    @staticmethod
    def wanted(compiler: str) -> bool:
        import subprocess

        if os.environ.get("SHARDKIT_PCH", "").strip() == "0":
            return False
        try:
            version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return False
        return "Free Software Foundation" in version and "clang" not in version.lower()

    def flags(self, compiler: str, cflags: list[str], post_cflags: list[str]) -> list[str]:
        """The flags that force-include the header (made now if out of date), or [] where it cannot be used."""
        import hashlib
        import shlex
        import subprocess
        import warnings

        import torch

        if not self.wanted(compiler):
            return []
        header = self.folder / "precompiled.h"  # the .gch must lie beside the header GCC is told to include
        gch = self.folder / "precompiled.h.gch"
        stamp = self.folder / "precompiled.key"
        # The header GCC is told to include includes csrc/precompiled.h: there (an included file, not the main one)
        # its `#pragma GCC system_header` holds, so torch's headers stay as quiet as when each source reads them.
        wrapper = f'#include "{self.HEADER}"\n'
        key = hashlib.sha256("\n".join([compiler, *cflags, "--", *post_cflags, torch.__version__, torch.__file__,
                                         wrapper, self.HEADER.read_text()]).encode()).hexdigest()
        if not (gch.exists() and stamp.exists() and stamp.read_text() == key):
            self.folder.mkdir(parents=True, exist_ok=True)
            header.write_text(wrapper)
            command = [compiler, *shlex.split(" ".join(cflags)), "-x", "c++-header", str(header), "-o", str(gch),
                       *shlex.split(" ".join(post_cflags))]
            print(f"shardkit: precompiling torch's headers ({self.HEADER.name}) for every source", flush=True)
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                gch.unlink(missing_ok=True)
                warnings.warn(f"shardkit: precompiling {self.HEADER} failed, building without it:\n"
                              f"{done.stderr[-2000:]}")
                return []
            stamp.write_text(key)
        return ["-include", shlex.quote(str(header))]

    def around(self, write_ninja_and_compile):
        """torch's ``_write_ninja_file_and_compile_objects``, with the header added to its C++ flags.

        csrc/core/ includes no torch header (it is the torch-free C++17 layer the GoogleTest build compiles on its
        own): loading the precompiled header would cost each of its sources ~5 s for nothing (measured: the folder
        32 s of CPU without it, 108 s with it). Its sources compile first, in a ninja run of their own without it."""
        from torch.utils.cpp_extension import get_cxx_compiler

        def compile_objects(*args, **kwargs):
            names = ("sources", "objects", "cflags", "post_cflags")
            if args or not all(name in kwargs for name in names):  # torch passes them by name (2.11 - 2.14)
                return write_ninja_and_compile(*args, **kwargs)
            pairs = list(zip(kwargs["sources"], kwargs["objects"]))
            torch_free = [(s, o) for s, o in pairs if Path(s).resolve().parent == CSRC / "core"]
            if torch_free:
                write_ninja_and_compile(**{**kwargs, "sources": [s for s, _ in torch_free],
                                           "objects": [o for _, o in torch_free]})
            rest = [(s, o) for s, o in pairs if (s, o) not in torch_free]
            extra = self.flags(get_cxx_compiler(), kwargs["cflags"], kwargs["post_cflags"])
            return write_ninja_and_compile(**{**kwargs, "sources": [s for s, _ in rest],
                                              "objects": [o for _, o in rest],
                                              "post_cflags": [*kwargs["post_cflags"], *extra]})

        return compile_objects


def _cmdclass():
    import sys
    import sysconfig

    import torch.utils.cpp_extension as cpp_extension
    from torch.utils.cpp_extension import BuildExtension

    class BuildExtensionInOneTree(BuildExtension.with_options(use_ninja=True)):
        """torch's ninja build, its objects always in build/temp.<platform>-<python>: an editable install
        (``pip install -e .``, which setuptools builds in a fresh temporary folder) and a wheel (``pip wheel .``,
        in build/) then share one object tree, and ninja recompiles only what changed since either. `make test`
        builds both (the .venv's editable install, then test_clean_install's wheel): the second costs a link,
        not a second compile of every source."""

        def finalize_options(self) -> None:
            super().finalize_options()
            self.build_temp = str(ROOT / "build" / f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")

        def build_extensions(self) -> None:
            # torch's ninja step is a module-level function its compile wrapper looks up when it runs: wrapped for
            # this build only (see _PrecompiledTorchHeaders).
            original = cpp_extension._write_ninja_file_and_compile_objects
            cpp_extension._write_ninja_file_and_compile_objects = _PrecompiledTorchHeaders(self.build_temp).around(
                original)
            try:
                super().build_extensions()
            finally:
                cpp_extension._write_ninja_file_and_compile_objects = original

    return {"build_ext": BuildExtensionInOneTree}


setup(
    packages=find_packages("python"),
    # torch's extension autoloading entry point (pyproject.toml, "torch.backends"): outside the package, so that
    # torch loading it at `import torch` does not load shardkit's extension.
    py_modules=["_shardkit_autoload"],
    package_dir={"": "python"},
    # PEP 561: the package's inline annotations are for type checkers, and _C.pyi types the compiled extension.
    package_data={"shardkit": ["py.typed", "_C.pyi"]},
    ext_modules=get_extensions(),
    cmdclass=_cmdclass(),
)
