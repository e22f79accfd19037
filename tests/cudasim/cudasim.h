// cudasim.h: run kernels/*.cu on the CPU, one C++ fiber per CUDA thread, for machines without a GPU.
//
// What it is for. The kernels are checked against their numpy oracles on a GPU (tests/test_cuda_*.py).
// Without one, this header lets the same sources, unchanged, run under g++: tests/cudasim/fake_cupy.py
// compiles each kernel file with this header force-included, launches the kernels through ctypes with
// CuPy's grid/block/argument conventions, and so the GPU tests run on the CPU. It checks the parts of a
// kernel that do not depend on the hardware: indexing, launch geometry, argument types against the
// kernel's parameters, barriers and warp-synchronous code, shared-memory races that show up as a
// different result when threads run in another order. It says nothing about speed, the compiler's
// NVRTC dialect, the device's float rounding (expf, fma contraction) or the real memory model.
//
// The execution model. Blocks run one after another. The threads of a block are fibers (coroutines) on
// the calling OS thread; a fiber runs until it reaches a synchronisation point and then gives way:
//   __syncthreads()                    waits until every thread of the block that has not exited is there;
//   __syncwarp(mask), __shfl_*_sync,   wait until every lane named in mask is at a warp synchronisation
//   wmma::*_sync (mma.h)               (the lanes must exist and must not have exited: an error otherwise).
// Between those points one thread runs alone, which is one legal interleaving of the real machine.
// The scheduler runs one warp as far as it can go (to a __syncthreads, its end, or a lane that waits
// for another warp) before the next, so a warp runs ahead of the others as far as CUDA allows.
// XTRAIN_CUDASIM_ORDER picks the order of warps, of lanes within a warp, and of blocks: forward,
// reverse, or a seeded shuffle. A kernel that is correct under CUDA's rules gives the same result in
// every order; one that reads what another warp writes without a barrier between usually does not.
// A barrier that not every thread reaches (a deadlock on the GPU) ends the launch with an error naming
// the threads, and so do __trap() and a thread touching unmapped memory (on_fault). Accesses just
// outside an array are fake_cupy's to catch, with the guard bytes around every allocation.
//
// __shared__ variables become function statics: one copy, shared by the threads of the block that is
// running, which is what shared memory is when blocks run one at a time. They are placed in a section
// of their own, which the scheduler fills with 0xFF bytes (NaN as float) before each block, so a block
// that reads shared memory it did not write sees garbage, as on a GPU, not the previous block's values.
//
// Two libraries. The runtime (the scheduler, the fibers, the fault handler: the part under CUDASIM_RUNTIME at
// the end) is compiled once into a library of its own, which the library of every kernel file links against;
// a kernel file's library holds its kernels, the device functions below that they inline, and a launch stub
// per kernel. With a copy of the runtime in every kernel file's library, g++ spent most of each compile on it
// (1.4 of gelu.cu's 2.3 s), and the simulated suite compiles a library for each of some 60 files and variants.
#pragma once

// kernels/ptx.cuh's inline PTX (mma.sync, ldmatrix, cp.async) has CPU versions under this macro
// (include/cudasim_ptx.h), which g++ compiles instead of the asm statements.
#define XTRAIN_CUDASIM 1

#include <signal.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static __attribute__((section("cudasim_shared")))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
};

// The built-in variables: one set for the process, in the runtime (below), as one launch runs at a time.
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
constexpr int warpSize = 32;

// the linker's bounds of the section holding every __shared__ variable (weak: a file may have none)
extern "C" char __start_cudasim_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_cudasim_shared[] __attribute__((weak, visibility("hidden")));

namespace cudasim {

enum class State { runnable, at_block_barrier, at_warp_barrier, done };

// Switching between fibers. On x86-64 a few instructions that save the callee-saved registers on the
// old stack and restore them from the new one (glibc's swapcontext also saves the signal mask, a system
// call per switch, which made the simulator ten times slower); elsewhere ucontext.
#if defined(__x86_64__)
extern "C" void cudasim_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .p2align 4
    .globl cudasim_switch
    .hidden cudasim_switch
    .type cudasim_switch, @function
cudasim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cudasim_switch, .-cudasim_switch
)");
struct Context {
    void* sp;
};
#else
struct Context {
    ucontext_t uc;
};
#endif

// A cp.async copy issued and not yet done: it lands at the cp.async.wait_group that covers its group
// (include/cudasim_ptx.h), so a read of its destination before that wait sees what was there before.
struct AsyncCopy {
    void* dst;
    const void* src;
    int bytes, src_bytes;  // bytes past src_bytes are zero-filled
    unsigned group;        // the commit group it belongs to (the count of commits before it)
};

struct Fiber {
    Context context;
    State state;
    unsigned warp_mask;   // the lanes a warp synchronisation waits for
    unsigned shuffles;    // shuffles done: selects the exchange buffer (see exchange())
    unsigned gathers;     // warp gathers done: selects the wide exchange buffer (see exchange())
    std::vector<AsyncCopy> async_copies;  // cp.async copies not yet waited for
    unsigned async_groups;                // cp.async.commit_group calls so far
    uint3 index;
};

constexpr int MAX_THREADS = 1024;
constexpr size_t STACK_BYTES = 256 * 1024;  // flash attention keeps whole WMMA tiles per thread (mma.h)
// Each fiber's stack starts STACK_COLOUR bytes further into its allocation than the one before (thread t at
// t * STACK_COLOUR, modulo STACK_COLOURS of them). The allocations are all aligned alike, so without it the
// tops of a block's stacks, which the scheduler visits in turn, fall into the same few sets of the CPU's
// caches and evict one another at every switch.
constexpr size_t STACK_COLOUR = 64, STACK_COLOURS = 1024;
constexpr size_t STACK_ALLOCATION = STACK_BYTES + STACK_COLOUR * STACK_COLOURS;

struct Launch {
    std::vector<Fiber> fibers;
    std::vector<char*> stacks;
    int current = 0;
    int n_threads = 0;
    const int* lanes = nullptr;  // the warp's lanes in the order they run (XTRAIN_CUDASIM_ORDER), 32 of them
    int lane_slot = 0;           // the running lane's place in `lanes`
    bool in_fiber = false;  // a kernel thread is running (a fault there is the kernel's)
    Context scheduler;
    void (*body)(void (*kernel)(), void** args);  // calls kernel with its arguments: launch()'s typed call
    void (*kernel)();
    void** args;
    std::string error;
    // per warp and lane, two exchange slots of up to 8 bytes for shuffles
    unsigned char exchange[MAX_THREADS / 32][2][32][8];
    // and two of up to 64 bytes for warp-wide instructions (mma.sync's fragments, ldmatrix's addresses)
    unsigned char wide_exchange[MAX_THREADS / 32][2][32][64];
};

// The runtime's part, compiled once (CUDASIM_RUNTIME, at the end of this file): the state of the launch
// that is running, the errors a thread ends it with, and the scheduler.
extern Launch running_launch;
inline Launch& launch_state() { return running_launch; }
std::string thread_name(const uint3& t);
[[noreturn]] void fail(const std::string& why);  // end the launch from inside a thread (never resumed)
int run(const unsigned* grid, const unsigned* block, unsigned long long order, char* shared_begin, char* shared_end,
        char* error, int error_size);
void give_way(Context& from);  // the running fiber, parked: on to the warp's next runnable lane, or the scheduler

// Go from `from` to `to`, saving where `from` was.
inline void switch_to(Context& from, Context& to) {
#if defined(__x86_64__)
    cudasim_switch(&from.sp, to.sp);
#else
    swapcontext(&from.uc, &to.uc);
#endif
}

// Park the running fiber in `state` and give way (to the warp's next runnable lane, or the scheduler);
// returns when it is resumed.
inline void wait(State state, unsigned mask = 0) {
    Launch& l = launch_state();
    Fiber& f = l.fibers[l.current];
    f.state = state;
    f.warp_mask = mask;
    give_way(f.context);  // back here when this fiber is resumed (threadIdx set to its own again)
}

inline int linear_thread() { return launch_state().current; }

inline void warp_barrier(unsigned mask) {
    const int lane = linear_thread() % 32;
    if (!(mask >> lane & 1u))
        fail(thread_name(threadIdx) + ": warp synchronisation with a mask that leaves out its own lane");
    wait(State::at_warp_barrier, mask);
}

// The meeting of shuffles and warp gathers: this lane parks `bytes` of `value` in its slot of one of the
// warp's two buffers, the lanes of `mask` meet, and the buffer's 32 slots are returned, to be read in place.
// The buffers alternate (`count`: this lane's exchanges of this kind so far), so a lane that has read may go
// on to its next exchange, writing the other buffer, while slower lanes still read this one; it cannot get two
// ahead, because the next meeting waits for every lane. So the slots hold until this lane's next exchange.
template <size_t N>
const unsigned char (*exchange(unsigned char (&buffers)[MAX_THREADS / 32][2][32][N], unsigned& count,
                               const void* value, size_t bytes, unsigned mask))[N] {
    const int me = linear_thread();
    unsigned char (&slots)[32][N] = buffers[me / 32][count++ & 1u];
    std::memcpy(slots[me % 32], value, bytes);
    warp_barrier(mask);
    return slots;
}

// A shuffle: every lane of the mask parks its value, they meet, each reads its source lane's value.
template <typename T>
T shuffle(unsigned mask, T value, int source) {
    static_assert(sizeof(T) <= 8, "cudasim: shuffles move at most 8 bytes");
    Launch& l = launch_state();
    const auto slots = exchange(l.exchange, l.fibers[linear_thread()].shuffles, &value, sizeof(T), mask);
    if (!(mask >> source & 1u))
        fail(thread_name(threadIdx) + ": shuffle reads lane " + std::to_string(source) + ", which is not in the mask");
    T out;
    std::memcpy(&out, slots[source], sizeof(T));
    return out;
}

// A warp-wide instruction's exchange: every lane of the warp parks `value`, they meet, and each gets the
// 32 lanes' slots, lane i's value at the start of slot i, read in place until its next gather.
using Slots = const unsigned char (*)[64];
template <typename T>
Slots gather_slots(const T& value) {
    static_assert(sizeof(T) <= 64, "cudasim: a warp gather moves at most 64 bytes a lane");
    Launch& l = launch_state();
    return exchange(l.wide_exchange, l.fibers[linear_thread()].gathers, &value, sizeof(T), 0xffffffffu);
}

// The same exchange, each lane's value copied out: lane i's at [i].
template <typename T>
std::array<T, 32> gather(const T& value) {
    const Slots slots = gather_slots(value);
    std::array<T, 32> all;
    for (int i = 0; i < 32; ++i) std::memcpy(&all[i], slots[i], sizeof(T));
    return all;
}


// ------------------------------------------------------------------ kernels as C functions

// A parameter's kind as the Python side checks it against the value passed: p (pointer), pc (pointer to
// const: the kernel only reads through it, which tells the stream checker), iN, uN, fN (integer,
// unsigned, floating point of N bytes).
template <typename T>
std::string kind() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<U>) return std::is_const_v<std::remove_pointer_t<U>> ? "pc" : "p";
    else if constexpr (std::is_floating_point_v<U>) return "f" + std::to_string(sizeof(U));
    else if constexpr (std::is_integral_v<U> && std::is_signed_v<U>) return "i" + std::to_string(sizeof(U));
    else if constexpr (std::is_integral_v<U>) return "u" + std::to_string(sizeof(U));
    else return "?" + std::to_string(sizeof(U));
}

template <typename... A>
std::string signature(void (*)(A...)) {
    std::string s;
    ((s += kind<A>() + ","), ...);
    return s;
}

// args[i] points at the value of parameter i, as cuLaunchKernel's kernelParams do.
template <typename... A, size_t... I>
void invoke(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <typename... A>
void call(void (*kernel)(), void** args) {
    invoke(reinterpret_cast<void (*)(A...)>(kernel), args, std::index_sequence_for<A...>{});
}

// Runs in the kernel's library, so the shared-memory section it hands the scheduler is the kernel file's.
template <typename... A>
int launch(void (*kernel)(A...), const unsigned* grid, const unsigned* block, void** args, unsigned long long order,
           char* error, int error_size) {
    Launch& l = launch_state();
    l.body = &call<A...>;
    l.kernel = reinterpret_cast<void (*)()>(kernel);
    l.args = args;
    return run(grid, block, order, __start_cudasim_shared, __stop_cudasim_shared, error, error_size);
}

}  // namespace cudasim

// ------------------------------------------------------------------ the device functions the kernels use

inline void __syncthreads() { cudasim::wait(cudasim::State::at_block_barrier); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { cudasim::warp_barrier(mask); }

template <typename T>
T __shfl_sync(unsigned mask, T value, int source, int width = 32) {
    const int lane = cudasim::linear_thread() % 32;
    return cudasim::shuffle(mask, value, (lane / width) * width + source % width);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
    const int lane = cudasim::linear_thread() % 32, source = lane ^ lane_mask;
    return cudasim::shuffle(mask, value, source / width > lane / width ? lane : source);  // no later groups
}
template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
    const int lane = cudasim::linear_thread() % 32, source = lane + (int)delta;
    return cudasim::shuffle(mask, value, source / width != lane / width ? lane : source);
}

[[noreturn]] inline void __trap() { cudasim::fail(cudasim::thread_name(threadIdx) + " called __trap()"); }

inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline float __fadd_rn(float a, float b) { return a + b; }  // compiled with -ffp-contract=off: never fused
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }
template <typename T> inline T __ldg(const T* p) { return *p; }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }


// ================================================================== the runtime
// Compiled once per text of this file into a library of its own (fake_cupy.py defines CUDASIM_RUNTIME for it),
// which every kernel file's library links against.
#if defined(CUDASIM_RUNTIME)

#include <random>

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace cudasim {

void fiber_main();

Launch running_launch;

#if defined(__x86_64__)
[[noreturn]] void fiber_entry() {
    fiber_main();
    Context unused;  // this fiber is never resumed
    give_way(unused);
    __builtin_unreachable();
}
#endif

// A fresh fiber that starts in fiber_main() on `stack` and goes back to the scheduler when it ends.
void start_fiber(Context& c, char* stack, size_t size) {
#if defined(__x86_64__)
    auto* top = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15));
    *--top = 0;                                                  // fiber_entry's return address: never used
    *--top = reinterpret_cast<uint64_t>(&fiber_entry);           // where the first switch's ret goes
    for (int i = 0; i < 6; ++i) *--top = 0;                      // rbp rbx r12-r15
    c.sp = top;
#else
    Launch& l = launch_state();
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = &l.scheduler.uc;
    makecontext(&c.uc, fiber_main, 0);
#endif
}

std::string thread_name(const uint3& t) {
    return "thread (" + std::to_string(t.x) + "," + std::to_string(t.y) + "," + std::to_string(t.z) + ") of block (" +
           std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) + ")";
}

// End the launch from inside a thread (the fiber is never resumed).
[[noreturn]] void fail(const std::string& why) {
    Launch& l = launch_state();
    if (l.error.empty()) l.error = why;
    Fiber& f = l.fibers[l.current];
    f.state = State::done;
    switch_to(f.context, l.scheduler);  // never resumed
    __builtin_unreachable();
}

// A kernel thread touching unmapped memory (a wild index) ends the launch with an error naming the
// thread and the address, instead of killing the process; a fault anywhere else keeps its default action.
void on_fault(int sig, siginfo_t* info, void*) {
    Launch& l = launch_state();
    if (!l.in_fiber) {
        signal(sig, SIG_DFL);  // not a kernel's: returning re-runs the access, which now ends the process
        return;
    }
    char address[48];
    if (info->si_addr == nullptr) std::snprintf(address, sizeof address, "an address the CPU refuses outright");
    else std::snprintf(address, sizeof address, "%p", info->si_addr);
    l.in_fiber = false;
    fail(thread_name(threadIdx) + ": invalid memory access at " + address);
}

// Installs on_fault for one launch and puts back what was there (Python's faulthandler, say) after it.
struct FaultGuard {
    struct sigaction old_segv, old_bus;
    FaultGuard() {
        struct sigaction fault = {};
        fault.sa_sigaction = on_fault;
        fault.sa_flags = SA_SIGINFO | SA_NODEFER;  // not blocked after we leave the handler by a switch
        sigemptyset(&fault.sa_mask);
        sigaction(SIGSEGV, &fault, &old_segv);
        sigaction(SIGBUS, &fault, &old_bus);
    }
    ~FaultGuard() {
        sigaction(SIGSEGV, &old_segv, nullptr);
        sigaction(SIGBUS, &old_bus, nullptr);
    }
};

// Resume order of runnable threads and of blocks: 0 forward, 1 reverse, else a shuffle seeded by it.
std::vector<int> visit_order(int n, unsigned long long order) {
    std::vector<int> out(n);
    for (int i = 0; i < n; ++i) out[i] = i;
    if (order == 1) std::reverse(out.begin(), out.end());
    if (order > 1) std::shuffle(out.begin(), out.end(), std::mt19937_64(order));
    return out;
}

void fiber_main() {
    Launch& l = launch_state();
    l.body(l.kernel, l.args);
    Fiber& f = l.fibers[l.current];
    if (!f.async_copies.empty() && l.error.empty())
        l.error = thread_name(f.index) + " exited with " + std::to_string(f.async_copies.size()) +
                  " cp.async copies it never waited for (cp.async.wait_group)";
    f.state = State::done;  // then on to the warp's next lane (fiber_entry), or back to the scheduler (uc_link)
}

// Release warp w's lanes waiting at a warp barrier if every lane they name has arrived. False if not.
bool release_warp(int w, int n_threads) {
    Launch& l = launch_state();
    int first = -1;
    for (int lane = 0; lane < 32 && w * 32 + lane < n_threads; ++lane)
        if (l.fibers[w * 32 + lane].state == State::at_warp_barrier) { first = w * 32 + lane; break; }
    if (first < 0) return false;
    const unsigned mask = l.fibers[first].warp_mask;
    for (int lane = 0; lane < 32; ++lane) {
        if (!(mask >> lane & 1u)) continue;
        const int t = w * 32 + lane;
        if (t >= n_threads) {
            l.error = thread_name(l.fibers[first].index) + ": warp synchronisation names lane " + std::to_string(lane) +
                      ", which does not exist in a block of " + std::to_string(n_threads) + " threads";
            return false;
        }
        const Fiber& f = l.fibers[t];
        if (f.state == State::done) {
            l.error = thread_name(l.fibers[first].index) + ": warp synchronisation waits for " + thread_name(f.index) +
                      ", which has exited";
            return false;
        }
        if (f.state != State::at_warp_barrier || f.warp_mask != mask) return false;
    }
    for (int lane = 0; lane < 32; ++lane)
        if (mask >> lane & 1u) l.fibers[w * 32 + lane].state = State::runnable;
    return true;
}

// A pass over a warp's lanes hands over from lane to lane without the scheduler: a lane that parks (or
// exits) switches straight to the next runnable lane of its warp in `lanes` order, and only the last goes
// back. The order is the scheduler's own (run_warp's); each hand-over is one switch instead of two.
void give_way(Context& from) {
    Launch& l = launch_state();
    if (l.error.empty()) {
        const int warp_first = l.current - l.current % 32;
        for (int slot = l.lane_slot + 1; slot < 32; ++slot) {
            const int t = warp_first + l.lanes[slot];
            if (t >= l.n_threads || l.fibers[t].state != State::runnable) continue;
            l.lane_slot = slot;
            l.current = t;
            threadIdx = l.fibers[t].index;
            switch_to(from, l.fibers[t].context);
            return;
        }
    }
    switch_to(from, l.scheduler);
}

// Run warp w as far as it goes: its runnable lanes in `lanes` order, then its warp barriers as they
// fill, until every lane waits at __syncthreads, has exited, or waits for a lane that cannot come.
// One warp running ahead of the others is what exposes a missing __syncthreads: it overwrites shared
// memory the others have not read yet, or reads what they have not written.
bool run_warp(int w, const std::vector<int>& lanes, int n_threads) {
    Launch& l = launch_state();
    bool progressed = false;
    for (;;) {
        bool ran = false;
        for (int slot = 0; slot < 32; ++slot) {
            const int t = w * 32 + lanes[slot];
            if (t >= n_threads || l.fibers[t].state != State::runnable) continue;
            l.lane_slot = slot;
            l.current = t;
            threadIdx = l.fibers[t].index;
            l.in_fiber = true;
            switch_to(l.scheduler, l.fibers[t].context);  // back when the pass's last lane gives way
            l.in_fiber = false;
            ran = true;
            if (!l.error.empty()) return true;
            slot = l.lane_slot;  // the lanes up to there ran in this pass
        }
        if (!ran && !release_warp(w, n_threads)) return progressed;
        progressed = true;
    }
}

std::string where_everyone_is(int n_threads) {
    Launch& l = launch_state();
    int counts[4] = {0, 0, 0, 0};
    for (int t = 0; t < n_threads; ++t) counts[(int)l.fibers[t].state]++;
    return std::to_string(counts[1]) + " at __syncthreads, " + std::to_string(counts[2]) +
           " at a warp synchronisation, " + std::to_string(counts[3]) + " exited";
}

int run(const unsigned* grid, const unsigned* block, unsigned long long order, char* shared_begin, char* shared_end,
        char* error, int error_size) {
    Launch& l = launch_state();
    const int n_threads = (int)(block[0] * block[1] * block[2]);
    if (n_threads < 1 || n_threads > MAX_THREADS) {
        std::snprintf(error, error_size, "block of %d threads (CUDA allows 1 to %d)", n_threads, MAX_THREADS);
        return 1;
    }
    l.error.clear();
    const FaultGuard fault_guard;
    l.fibers.resize(n_threads);
    while ((int)l.stacks.size() < n_threads) l.stacks.push_back(new char[STACK_ALLOCATION]);
    blockDim = {block[0], block[1], block[2]};
    gridDim = {grid[0], grid[1], grid[2]};
    const long long n_blocks = (long long)grid[0] * grid[1] * grid[2];
    const int n_warps = (n_threads + 31) / 32;
    const std::vector<int> warps = visit_order(n_warps, order), lanes = visit_order(32, order);
    l.lanes = lanes.data();  // for give_way, this launch's
    l.n_threads = n_threads;
    for (long long bb = 0; bb < n_blocks; ++bb) {
        const long long b = order == 0 ? bb : (order == 1 ? n_blocks - 1 - bb : (bb * 2654435761ll + order) % n_blocks);
        blockIdx = {(unsigned)(b % grid[0]), (unsigned)(b / grid[0] % grid[1]), (unsigned)(b / grid[0] / grid[1])};
        if (shared_begin != nullptr) std::memset(shared_begin, 0xFF, shared_end - shared_begin);
        for (int t = 0; t < n_threads; ++t) {
            Fiber& f = l.fibers[t];
            f.state = State::runnable;
            f.shuffles = 0;
            f.gathers = 0;
            f.async_copies.clear();
            f.async_groups = 0;
            f.index = {(unsigned)(t % block[0]), (unsigned)(t / block[0] % block[1]), (unsigned)(t / block[0] / block[1])};
            start_fiber(f.context, l.stacks[t], STACK_BYTES + STACK_COLOUR * (t % STACK_COLOURS));
        }
        for (;;) {
            bool progressed = false;
            for (int w : warps) {
                progressed |= run_warp(w, lanes, n_threads);
                if (!l.error.empty()) break;
            }
            if (!l.error.empty()) break;
            if (progressed) continue;
            int at_block = 0, at_warp = 0, done = 0;
            for (int t = 0; t < n_threads; ++t) {
                at_block += l.fibers[t].state == State::at_block_barrier;
                at_warp += l.fibers[t].state == State::at_warp_barrier;
                done += l.fibers[t].state == State::done;
            }
            if (done == n_threads) break;
            if (at_warp == 0 && at_block > 0) {
                for (int t = 0; t < n_threads; ++t)
                    if (l.fibers[t].state == State::at_block_barrier) l.fibers[t].state = State::runnable;
                continue;
            }
            l.error = "deadlock in block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," +
                      std::to_string(blockIdx.z) + "): " + where_everyone_is(n_threads);
            break;
        }
        if (!l.error.empty()) {
            std::snprintf(error, error_size, "%s", l.error.c_str());
            return 1;
        }
    }
    return 0;
}

}  // namespace cudasim

#endif  // CUDASIM_RUNTIME
