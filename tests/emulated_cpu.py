"""An emulated x86-64 CPU with AVX-512, so the kernels' AVX-512 paths are tested on machines
without it (most of this project's, and CI's): Bochs's CPU, through the bochscpu-python
package, set to its Sapphire Rapids model (AVX-512 F/DQ/BW/VL, VNNI, BF16).

tests/emulated_kernels.cpp includes the kernel sources as they are; `build_image` compiles it
with g++ at the library's -O3 into a static image with no C library. `run` executes calls of
its entry points in a child process (the emulator's bindings crash at interpreter exit, and a
fault must not take the test runner with it): each call's arrays sit in one block of guest
memory, its Arena, which comes back after the call, checked to be unchanged outside the
arrays the call may write. The emulated CPU runs the instructions, not their timing: this
checks results, never speed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np

ARENA = 0x1000_0000  # guest address of every call's arena
_STACK, _STACK_BYTES = 0x7F00_0000, 256 * 1024
_EXIT = 0x7E00_0000  # the return address: a page holding one hlt
_PAGE = 4096
_KERNELS = Path(__file__).parent.parent / "radixserve" / "kernels" / "csrc"
_SOURCES = [Path(__file__).with_name(name)
            for name in ("emulated_kernels.cpp", "emulated_libc.cpp")]
_GUARD = 4096  # zero bytes after each arena that no call may write

# CPU models by their index in the Bochs 3.0 list that bochscpu-python 0.4.0 builds. Its own
# setting offers only a shorter, older list and sets Cannon Lake (AVX-512 without VNNI), so
# the index is written into the setting directly; the tests check the result with CPUID.
MODELS = {"corei3_cnl": 27, "corei7_icelake_u": 28, "tigerlake": 29, "sapphire_rapids": 30}

# That wheel links two glibc 2.38 symbols; on an older glibc (Debian 12 has 2.36) these
# stand-ins, loaded first, let it load.
_GLIBC_SHIM = r"""
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
unsigned long long __isoc23_strtoull(const char* s, char** end, int base) {
  return strtoull(s, end, base);
}
int __isoc23_sscanf(const char* s, const char* format, ...) {
  va_list args;
  va_start(args, format);
  int n = vsscanf(s, format, args);
  va_end(args);
  return n;
}
"""

_VECTORS = {0: "#DE divide error", 6: "#UD invalid opcode", 13: "#GP general protection",
            14: "#PF page fault", 17: "#AC alignment check", 19: "#XM SIMD floating point"}


@dataclass
class Arena:
    """A call's guest memory: arrays placed one after another, each 64-byte aligned. Inputs
    (`put`) must come back unchanged; only outputs (`output`) may be written."""

    data: bytearray = field(default_factory=bytearray)
    outputs: list[tuple[int, int]] = field(default_factory=list)  # (offset, bytes)

    def put(self, array: np.ndarray | bytes) -> int:
        """Copies `array` in and returns its guest address."""
        raw = array if isinstance(array, bytes) else np.ascontiguousarray(array).tobytes()
        self.data.extend(bytes(-len(self.data) % 64))
        address = ARENA + len(self.data)
        self.data.extend(raw)
        return address

    def output(self, shape: tuple[int, ...], dtype: type | np.dtype) -> int:
        """A zeroed array that the call may write (results, scratch); its guest address."""
        address = self.put(np.zeros(shape, dtype))
        self.outputs.append((address - ARENA, len(self.data) - (address - ARENA)))
        return address


def read(arena: bytes, address: int, shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
    """The array at guest `address` of an arena that `run` returned."""
    dtype = np.dtype(dtype)
    offset = address - ARENA
    size = int(np.prod(shape)) * dtype.itemsize
    return np.frombuffer(arena[offset:offset + size], dtype).reshape(shape).copy()


@dataclass(frozen=True)
class Call:
    """One call of an entry point: up to six integer or pointer arguments (System V order)."""

    function: str
    args: tuple[int, ...]
    arena: Arena


class EmulationFault(RuntimeError):
    """The emulated CPU raised an exception (an instruction it lacks, a bad address) instead
    of returning from the call."""


def missing() -> str | None:
    """Why the emulated CPU cannot run here (a skip reason), or None."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return "the emulated CPU runs on x86-64 Linux only"
    if importlib.util.find_spec("bochscpu") is None:
        return "bochscpu-python is not installed (pip install -e '.[test]')"
    if shutil.which("g++") is None or shutil.which("gcc") is None:
        return "no g++/gcc to build the image"
    return None


def build_image(folder: Path) -> Path:
    """Compiles emulated_kernels.cpp into a static x86-64 image (no C library) in `folder`."""
    from torch.utils.cpp_extension import include_paths

    image = folder / "emulated_kernels.elf"
    command = ["g++", "-std=c++17", "-O3", "-fno-exceptions", "-fno-rtti",
               "-fno-asynchronous-unwind-tables", "-fno-stack-protector", "-fcf-protection=none",
               "-fno-pic", "-no-pie", "-static", "-nostdlib",
               # The linker wants an entry point; each call starts at its own function.
               "-Wl,-e,rs_cpuid", "-Wl,--build-id=none",
               f"-I{_KERNELS}", *(f"-I{path}" for path in include_paths()),
               *map(str, _SOURCES), "-o", str(image)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the emulated image failed:\n{done.stderr[-4000:]}")
    return image


def run(image: Path, calls: list[Call], model: str = "sapphire_rapids",
        timeout: float = 60) -> list[bytes]:
    """Runs `calls` in order on the emulated CPU `model` (a key of MODELS); each one's arena
    after its call. Raises EmulationFault where a call faults."""
    with tempfile.TemporaryDirectory(prefix="emulated-") as folder:
        job, results = Path(folder) / "job.pkl", Path(folder) / "results.pkl"
        jobs = [(call.function, call.args, bytes(call.arena.data)) for call in calls]
        job.write_bytes(pickle.dumps((str(image), MODELS[model], jobs)))
        env = dict(os.environ)
        if not hasattr(ctypes.CDLL(None), "__isoc23_strtoull"):
            env["RS_GLIBC_SHIM"] = str(_glibc_shim(Path(folder)))
        done = subprocess.run([sys.executable, __file__, str(job), str(results)], env=env,
                              capture_output=True, text=True, errors="replace", timeout=timeout)
        if done.returncode != 0 or not results.exists():
            raise RuntimeError(f"the emulator's process failed ({done.returncode}):\n"
                               f"{done.stderr[-4000:]}")
        outcomes = pickle.loads(results.read_bytes())
    arenas = []
    for call, (fault, after) in zip(calls, outcomes, strict=True):
        if fault:
            raise EmulationFault(f"{call.function}: {fault}")
        if (offset := _written_outside(call.arena, after)) is not None:
            raise EmulationFault(f"{call.function} wrote outside its outputs, at arena offset "
                                 f"{offset} of {len(call.arena.data)}")
        arenas.append(after[:len(call.arena.data)])
    return arenas


def _written_outside(arena: Arena, after: bytes) -> int | None:
    """The first arena offset (guard bytes included) that changed but is no output's."""
    before = np.frombuffer(bytes(arena.data) + bytes(_GUARD), np.uint8)
    changed = before != np.frombuffer(after, np.uint8)
    for offset, size in arena.outputs:
        changed[offset:offset + size] = False
    where = np.flatnonzero(changed)
    return int(where[0]) if where.size else None


def _glibc_shim(folder: Path) -> Path:
    source, library = folder / "shim.c", folder / "shim.so"
    source.write_text(_GLIBC_SHIM)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", str(source), "-o", str(library)],
                   check=True, capture_output=True)
    return library


# ----- the child process -----

def _elf(path: str) -> tuple[list[tuple[int, bytes, int]], dict[str, tuple[int, int]]]:
    """An ELF64 image's loadable segments (address, bytes in the file, bytes in memory) and
    its symbols (name -> (address, size))."""
    data = Path(path).read_bytes()
    assert data[:5] == b"\x7fELF\x02", "not an ELF64 image"
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    segments = []
    for i in range(phnum):
        kind, _, offset, address, _, in_file, in_memory, _ = struct.unpack_from(
            "<IIQQQQQQ", data, phoff + i * phentsize)
        if kind == 1:  # PT_LOAD
            segments.append((address, data[offset:offset + in_file], in_memory))
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    symbols = {}
    for _, kind, _, _, offset, size, link, _, _, entry in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        names = sections[link][4]
        for j in range(size // entry):
            name, _, _, _, value, length = struct.unpack_from("<IBBHQQ", data, offset + j * entry)
            end = data.index(b"\0", names + name)
            symbols[data[names + name:end].decode()] = (value, length)
    return segments, symbols


def _where(symbols: dict[str, tuple[int, int]], rip: int) -> str:
    for name, (address, length) in symbols.items():
        if address <= rip < address + max(length, 1):
            return f"{rip:#x} in {name}"
    return f"{rip:#x}"


def _child(job_path: str, results_path: str) -> None:
    if os.environ.get("RS_GLIBC_SHIM"):
        ctypes.CDLL(os.environ["RS_GLIBC_SHIM"], mode=ctypes.RTLD_GLOBAL)
    import bochscpu
    import bochscpu.cpu
    import bochscpu.memory as memory

    image, model, calls = pickle.loads(Path(job_path).read_bytes())
    _set_model(bochscpu, model)
    segments, symbols = _elf(image)
    session = bochscpu.Session()

    def no_page(gpa: int) -> None:
        raise RuntimeError(f"guest physical page {gpa:#x} is not mapped")

    session.missing_page_handler = no_page
    table = memory.PageMapLevel4Table()
    mapped: dict[int, int] = {}  # guest virtual page -> guest physical page

    def map_pages(begin: int, end: int) -> None:
        for gva in range(begin - begin % _PAGE, end, _PAGE):
            if gva not in mapped:
                mapped[gva] = 0x100_0000 + len(mapped) * _PAGE
                memory.page_insert(mapped[gva], memory.allocate_host_page())
                table.insert(gva, mapped[gva], 1)  # writable

    for address, _, in_memory in segments:
        map_pages(address, address + in_memory)
    map_pages(_STACK, _STACK + _STACK_BYTES)
    map_pages(_EXIT, _EXIT + 1)
    map_pages(ARENA, ARENA + max(len(arena) for _, _, arena in calls) + _GUARD)
    cr3 = 0x10_0000
    for hva, gpa in table.commit(cr3):
        memory.page_insert(gpa, hva)
    for address, content, _ in segments:
        assert memory.virt_write(cr3, address, list(content))
    assert memory.virt_write(cr3, _EXIT, [0xF4])  # hlt

    outcomes = []
    for function, args, arena in calls:
        assert memory.virt_write(cr3, ARENA, list(arena + bytes(_GUARD)))
        state = bochscpu.State()
        bochscpu.cpu.set_long_mode(state)
        state.cr4 = state.cr4 | 1 << 9 | 1 << 10 | 1 << 18  # OSFXSR, OSXMMEXCPT, OSXSAVE
        state.xcr0 = 0xE7  # x87, SSE, AVX, opmask and both halves of the zmm state
        state.mxcsr = 0x1F80  # exceptions masked, round to nearest: as a process starts
        state.fpcw = 0x37F
        state.cr3 = cr3
        state.rsp = _STACK + _STACK_BYTES - 72  # as after a call: rsp + 8 is 16-byte aligned
        assert memory.virt_write(cr3, state.rsp, list(struct.pack("<Q", _EXIT)))
        state.rip = symbols[function][0]
        registers = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")[:len(args)]
        for register, value in zip(registers, args, strict=True):
            setattr(state, register, value % (1 << 64))
        # Flat ring-0 segments: ring 0 so that the return to the hlt page stops the run
        # (ring 3 would fault there); code 64-bit (L), data read/write.
        code, data = bochscpu.Segment(), bochscpu.Segment()
        for segment, selector, attributes in ((code, 0x8, 0x209B), (data, 0x10, 0xC093)):
            segment.present, segment.selector, segment.attr = True, selector, attributes
            segment.base, segment.limit = 0, 0xFFFF_FFFF
        state.cs = code
        state.ds = state.ss = state.es = state.fs = state.gs = data
        session.cpu.state = state
        stop: dict[str, int] = {}

        def on_exception(s: bochscpu.Session, cpu: int, vector: int, error: int,
                         stop: dict[str, int] = stop) -> None:
            stop["vector"] = vector
            s.stop()

        def on_hlt(s: bochscpu.Session, cpu: int, stop: dict[str, int] = stop) -> None:
            stop["hlt"] = 1
            s.stop()

        hook = bochscpu.Hook()
        hook.exception, hook.hlt = on_exception, on_hlt
        session.run([hook])
        if "vector" in stop or "hlt" not in stop:
            vector = stop.get("vector", -1)
            fault = (f"{_VECTORS.get(vector, f'exception {vector}')} near "
                     f"{_where(symbols, session.cpu.state.rip)}")
            outcomes.append((fault, b""))
        else:
            outcomes.append((None, bytes(memory.virt_read(cr3, ARENA, len(arena) + _GUARD))))
    Path(results_path).write_bytes(pickle.dumps(outcomes))
    os._exit(0)  # skips the bindings' teardown, which crashes


def _set_model(bochscpu: ModuleType, index: int) -> None:
    """Writes the CPU model's index into Bochs's setting (see MODELS), before any CPU exists."""
    library = ctypes.CDLL(bochscpu._bochscpu.__file__)
    get_enum = library._ZN13bx_real_sim_c14get_param_enumEPKcP10bx_param_c
    get_enum.restype, get_enum.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p,
                                                           ctypes.c_void_p]
    setting = get_enum(None, b"cpu.model", None)
    set_range = library._ZN14bx_param_num_c9set_rangeEmm
    set_range.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
    set_range(setting, 0, max(MODELS.values()))
    set_value = library._ZN14bx_param_num_c3setEl
    set_value.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    set_value(setting, index)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
