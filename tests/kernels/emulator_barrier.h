// The barrier both host emulators use for __syncthreads and for the warp collectives.
//
// Its only synchronisation is its own two words: arrivals are acq_rel adds on a counter
// (so the last arriver has seen everything every arriver did before arriving), and the
// last arriver releases a generation word that the waiters acquire. std::barrier would do
// as a barrier, but libstdc++ parks waiters through a process-wide table of waiter pools
// whose shared counters also order threads of *unrelated* barriers, and ThreadSanitizer
// sees that ordering: a missing __syncthreads between two warps could then go unreported.
// Waiting uses the futex system call directly, which orders nothing by itself.
#pragma once

#include <atomic>
#include <climits>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

class AaEmuBarrier {
public:
    explicit AaEmuBarrier(int n) : n_(n) {}
    AaEmuBarrier(const AaEmuBarrier&) = delete;
    AaEmuBarrier& operator=(const AaEmuBarrier&) = delete;

    void arrive_and_wait() {
        const unsigned gen = gen_.load(std::memory_order_acquire);
        if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
            count_.store(0, std::memory_order_relaxed);
            gen_.fetch_add(1, std::memory_order_release);
            syscall(SYS_futex, reinterpret_cast<unsigned*>(&gen_), FUTEX_WAKE_PRIVATE, INT_MAX,
                    nullptr, nullptr, 0);
            return;
        }
        for (int spin = 0; gen_.load(std::memory_order_acquire) == gen; ++spin) {
            if (spin < 64) continue;
            syscall(SYS_futex, reinterpret_cast<unsigned*>(&gen_), FUTEX_WAIT_PRIVATE, gen,
                    nullptr, nullptr, 0);
        }
    }

private:
    const int n_;
    std::atomic<int> count_{0};
    std::atomic<unsigned> gen_{0};
    static_assert(sizeof(std::atomic<unsigned>) == sizeof(unsigned), "futex word is 32 bits");
};
