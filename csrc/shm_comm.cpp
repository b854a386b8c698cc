// Collectives between processes on one host through a shared-memory segment.
//
// One segment per process group: a header of per-rank counters, then two buffers of one
// slot per rank. A collective is a sequence of rounds, one per chunk that fits a slot:
// every rank copies its chunk into its slot of buffer (round % 2), publishes the round in
// its `arrive` counter, waits until every rank has arrived, computes its output from the
// slots (all ranks read the slots in the same order, so all-reduce results are identical
// on every rank), and publishes the round in its `depart` counter. A rank only writes a
// buffer once every rank has departed from the round that last used it (round - 2).
//
// Every rank also publishes what it is doing (operation, dtype, element count) with each
// round, and checks that every rank does the same: ranks calling different collectives get
// an error on every rank, never each other's data. So does the call site the caller passes
// (a fingerprint of where in the program the collective was issued), so that two collectives
// of the same shape reached from different places are an error, not a swapped result.
// Waiting spins briefly, then yields, then sleeps ever longer (up to 1 ms; checking for
// Ctrl-C), watches the process of the rank it waits for (each rank publishes its pid): a
// rank that exited or died is an error naming it within ~0.1 s, and a rank that is alive but
// never arrives is an error after the timeout. After an error the segment refuses further
// use, and `failure()` tells the Python side what happened (kind, peer, its pid, seconds
// waited, the peer's description and call site), which names the ranks globally and the
// program's lines in its message. One collective at a time per segment.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/OpMathType.h>

#include <Python.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <fcntl.h>
#include <sched.h>
#include <stdexcept>
#include <string>
#include <csignal>
#include <cstdio>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <thread>
#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FSH_PAUSE() _mm_pause()
#else
#define FSH_PAUSE() ((void)0)
#endif

namespace {

constexpr int kMaxWorld = 64;
constexpr size_t kLine = 64;
constexpr size_t kHeader = 2 * kMaxWorld * kLine;

struct alignas(64) Counter {
  std::atomic<uint64_t> value;
  std::atomic<uint64_t> desc[2];  // what the rank does in rounds of each parity
  std::atomic<uint64_t> site[2];  // where in the program it was called from
  std::atomic<int64_t> pid;       // the rank's process (arrive counters only)
  char pad[kLine - 6 * sizeof(std::atomic<uint64_t>)];
};

// Whether process `pid` still runs (a zombie has exited: its parent has not reaped it yet).
bool process_alive(int64_t pid) {
  if (pid <= 0) return true;  // not published: nothing to watch
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no procfs: kill() said it exists
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');  // "pid (comm) S ...": the state after the name
  return !(close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X'));
}

enum Op : uint64_t { kSum = 1, kMax, kGather, kScatter, kAllToAll, kBarrier, kPermute };

const char* op_name(uint64_t op) {
  static const char* names[] = {"?", "all_reduce(sum)", "all_reduce(max)", "all_gather",
                                "reduce_scatter", "all_to_all", "barrier", "ppermute"};
  return op < 8 ? names[op] : "?";
}

// A dtype code of a round's description, named as Python names it ("torch.float32").
std::string dtype_name(uint64_t code) {
  if (code > static_cast<uint64_t>(at::ScalarType::NumOptions)) return "an unknown dtype";
  switch (static_cast<at::ScalarType>(code)) {
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kHalf: return "torch.float16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    case at::kBool: return "torch.bool";
    case at::kBFloat16: return "torch.bfloat16";
    default: return std::string("torch.") + c10::toString(static_cast<at::ScalarType>(code));
  }
}

// Kinds of failure, for `failure()`.
enum Failure : int64_t { kNone = 0, kOtherOp, kOtherSite, kExited, kTimeout, kInterrupted };

uint64_t describe(uint64_t op, at::ScalarType dtype, int64_t numel) {
  return (op << 56) | (static_cast<uint64_t>(dtype) << 48) |
         (static_cast<uint64_t>(numel) & ((uint64_t{1} << 48) - 1));
}
static_assert(sizeof(Counter) == kLine, "one counter per cache line");

std::string errno_text(const char* what, const std::string& name) {
  return std::string("fsharded shared-memory collectives: ") + what + " " + name + ": " +
         std::strerror(errno);
}

class ShmComm {
 public:
  ShmComm(const std::string& name, int64_t rank, int64_t world, int64_t slot_bytes, bool create,
          double timeout_s)
      : name_(name), rank_(rank), world_(world), slot_(slot_bytes), timeout_s_(timeout_s) {
    TORCH_CHECK(world >= 1 && world <= kMaxWorld, "shm comm: world size must be 1..", kMaxWorld);
    TORCH_CHECK(rank >= 0 && rank < world, "shm comm: rank out of range");
    TORCH_CHECK(slot_bytes >= 4096 && slot_bytes % kLine == 0, "shm comm: bad slot size");
    size_ = kHeader + 2 * static_cast<size_t>(world) * static_cast<size_t>(slot_bytes);
    int flags = create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR;
    int fd = shm_open(name.c_str(), flags, 0600);
    if (fd < 0) throw std::runtime_error(errno_text("cannot open segment", name));
    auto fail = [&](const std::string& what) {
      int e = errno;
      close(fd);
      if (create) shm_unlink(name.c_str());
      errno = e;
      throw std::runtime_error(errno_text(what.c_str(), name));
    };
    if (create && ftruncate(fd, static_cast<off_t>(size_)) != 0) fail("cannot size segment");
    // Reserve the pages now: a full /dev/shm then fails here, not with SIGBUS on first touch.
    if (create) {
      int e = posix_fallocate(fd, 0, static_cast<off_t>(size_));
      if (e != 0) {
        errno = e;
        fail("cannot reserve memory for segment");
      }
    }
    struct stat st;
    if (fstat(fd, &st) != 0) fail("cannot stat segment");
    if (static_cast<size_t>(st.st_size) != size_) {
      errno = EINVAL;
      fail("unexpected size (another program's segment, or a different layout) of segment");
    }
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) fail("cannot map segment");
    close(fd);
    base_ = static_cast<char*>(p);
    arrive_at(rank_)->pid.store(static_cast<int64_t>(getpid()), std::memory_order_release);
  }

  ~ShmComm() {
    if (base_ != nullptr) munmap(base_, size_);
  }

  // The name stays valid only until every rank has mapped the segment; then any rank
  // removes it, so nothing is left behind if the program dies.
  void unlink() { shm_unlink(name_.c_str()); }

  int64_t slot_bytes() const { return slot_; }

  // In place; a sum is then divided by `divisor` (a mean), rounded as torch rounds
  // `psum(x) / n`: the sum to the tensor's dtype first, then the quotient.
  void all_reduce_(at::Tensor& t, bool max, double divisor, uint64_t site) {
    std::lock_guard<std::mutex> lock(mu_);
    site_ = site;
    check(t, "all_reduce");
    TORCH_CHECK(divisor == 1.0 || at::isFloatingType(t.scalar_type()),
                "shm all_reduce: a divisor needs a floating-point tensor");
    const uint64_t desc = describe(max ? kMax : kSum, t.scalar_type(), t.numel());
    const int64_t esize = t.element_size();
    const int64_t n = t.numel();
    const int64_t chunk = slot_ / esize;
    char* data = static_cast<char*>(t.data_ptr());
    for (int64_t off = 0; off < n; off += chunk) {
      const int64_t c = std::min(chunk, n - off);
      char* mine = begin_round();
      std::memcpy(mine, data + off * esize, c * esize);
      arrive_and_wait(desc);
      reduce_into(t.scalar_type(), data + off * esize, c, 0, max, divisor);
      depart();
    }
  }

  // out (world * m) <- every rank's x (m), in rank order. `desc`, when not 0, is what the
  // round says this rank does instead of "all_gather of m elements" (an announcement of a
  // collective that runs elsewhere, such as a ppermute over torch.distributed).
  void all_gather(const at::Tensor& x, at::Tensor& out, uint64_t site, uint64_t desc) {
    std::lock_guard<std::mutex> lock(mu_);
    site_ = site;
    check(x, "all_gather");
    check(out, "all_gather");
    TORCH_CHECK(x.scalar_type() == out.scalar_type() && out.numel() == x.numel() * world_,
                "shm all_gather: output must hold world * input elements of the same dtype");
    const int64_t esize = x.element_size();
    const int64_t m = x.numel();
    const int64_t chunk = slot_ / esize;
    const char* src = static_cast<const char*>(x.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    for (int64_t off = 0; off < m; off += chunk) {
      const int64_t c = std::min(chunk, m - off);
      char* mine = begin_round();
      std::memcpy(mine, src + off * esize, c * esize);
      arrive_and_wait(desc != 0 ? desc : describe(kGather, x.scalar_type(), m));
      for (int64_t j = 0; j < world_; ++j) {
        std::memcpy(dst + (j * m + off) * esize, slot(buf_, j), c * esize);
      }
      depart();
    }
  }

  // out (m) <- sum over ranks of block `rank` of x (world * m).
  void reduce_scatter(const at::Tensor& x, at::Tensor& out, uint64_t site) {
    std::lock_guard<std::mutex> lock(mu_);
    site_ = site;
    check(x, "reduce_scatter");
    check(out, "reduce_scatter");
    TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.numel() == out.numel() * world_,
                "shm reduce_scatter: input must hold world * output elements of the same dtype");
    const int64_t esize = x.element_size();
    const int64_t m = out.numel();
    const int64_t chunk = slot_ / (esize * world_);
    TORCH_CHECK(chunk > 0, "shm reduce_scatter: slot too small for this world size");
    const char* src = static_cast<const char*>(x.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    for (int64_t off = 0; off < m; off += chunk) {
      const int64_t c = std::min(chunk, m - off);
      stage_blocks(begin_round(), src, m, off, c, esize);
      arrive_and_wait(describe(kScatter, x.scalar_type(), m));
      reduce_into(x.scalar_type(), dst + off * esize, c, rank_ * c, false, 1.0);
      depart();
    }
  }

  // out block j (m elements) <- block `rank` of rank j's x (world * m).
  void all_to_all(const at::Tensor& x, at::Tensor& out, uint64_t site) {
    std::lock_guard<std::mutex> lock(mu_);
    site_ = site;
    check(x, "all_to_all");
    check(out, "all_to_all");
    TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.numel() == out.numel() &&
                    x.numel() % world_ == 0,
                "shm all_to_all: input and output of world * m elements of the same dtype");
    const int64_t esize = x.element_size();
    const int64_t m = x.numel() / world_;
    const int64_t chunk = slot_ / (esize * world_);
    TORCH_CHECK(chunk > 0, "shm all_to_all: slot too small for this world size");
    const char* src = static_cast<const char*>(x.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    for (int64_t off = 0; off < m; off += chunk) {
      const int64_t c = std::min(chunk, m - off);
      stage_blocks(begin_round(), src, m, off, c, esize);
      arrive_and_wait(describe(kAllToAll, x.scalar_type(), m));
      for (int64_t j = 0; j < world_; ++j) {
        std::memcpy(dst + (j * m + off) * esize, slot(buf_, j) + rank_ * c * esize, c * esize);
      }
      depart();
    }
  }

  void barrier() {
    std::lock_guard<std::mutex> lock(mu_);
    site_ = 0;
    TORCH_CHECK(!broken_, "fsharded shared-memory collectives: segment ", name_, " is unusable (",
                broken_why_, ")");
    begin_round();
    arrive_and_wait(describe(kBarrier, at::kByte, 0));
    depart();
  }

  // The last failure: (kind, peer's group rank, its pid, seconds waited, the peer's
  // description and call site, this rank's description and call site, round, "reach" or
  // "finish"). Kind 0: none.
  py::tuple failure() const {
    return py::make_tuple(fail_kind_, fail_peer_, fail_pid_, fail_waited_, fail_desc_, fail_site_, desc_,
                          site_, static_cast<int64_t>(round_), fail_what_);
  }

  bool broken() const { return broken_; }

 private:
  void fail(Failure kind, int64_t j, int64_t pid, double waited, uint64_t desc, uint64_t site,
            const char* what) {
    broken_ = true;
    fail_kind_ = kind;
    fail_peer_ = j;
    fail_pid_ = pid;
    fail_waited_ = waited;
    fail_desc_ = desc;
    fail_site_ = site;
    fail_what_ = what;
  }

  Counter* arrive_at(int64_t j) const { return reinterpret_cast<Counter*>(base_) + j; }
  Counter* depart_at(int64_t j) const { return reinterpret_cast<Counter*>(base_) + kMaxWorld + j; }
  char* slot(int buf, int64_t j) const {
    return base_ + kHeader + (static_cast<size_t>(buf) * world_ + j) * static_cast<size_t>(slot_);
  }

  // Elements [off, off + c) of each of the world blocks (m elements each) of src, into this
  // rank's slot laid out (world, c): block j's piece first.
  void stage_blocks(char* mine, const char* src, int64_t m, int64_t off, int64_t c,
                    int64_t esize) const {
    for (int64_t j = 0; j < world_; ++j) {
      std::memcpy(mine + j * c * esize, src + (j * m + off) * esize, c * esize);
    }
  }

  void check(const at::Tensor& t, const char* op) const {
    TORCH_CHECK(!broken_, "fsharded shared-memory collectives: an earlier collective on segment ",
                name_, " failed (", broken_why_, "); the ranks are out of step, start again");
    TORCH_CHECK(t.device().is_cpu(), "shm ", op, ": CPU tensors only");
    TORCH_CHECK(t.is_contiguous(), "shm ", op, ": contiguous tensors only");
  }

  // Wait until rank j's counter `c` reaches round v (`what` the rank is to do there).
  void wait_ge(const Counter* c, uint64_t v, const char* what, int64_t j) {
    if (c->value.load(std::memory_order_acquire) >= v) return;
    auto start = std::chrono::steady_clock::now();
    double next_check = 0.1;  // seconds: Ctrl-C, the peer's process, the timeout
    for (uint64_t spins = 1;; ++spins) {
      if (c->value.load(std::memory_order_acquire) >= v) return;
      if (spins < 4096) {
        FSH_PAUSE();
        continue;
      }
      if (spins < 16384) {
        sched_yield();
        continue;
      }
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      // Longer waits sleep longer (a rank computing while the others wait costs little CPU).
      std::this_thread::sleep_for(std::chrono::microseconds(waited < 0.01 ? 50 : waited < 0.1 ? 200 : 1000));
      if (waited < next_check) continue;
      next_check = waited + 0.1;
      {
        py::gil_scoped_acquire gil;
        if (PyErr_CheckSignals() != 0) {
          fail(kInterrupted, j, 0, waited, 0, 0, what);
          broken_why_ = "interrupted";
          throw py::error_already_set();
        }
      }
      const int64_t pid = arrive_at(j)->pid.load(std::memory_order_acquire);
      if (c->value.load(std::memory_order_acquire) < v && !process_alive(pid)) {
        fail(kExited, j, pid, waited, 0, 0, what);
        broken_why_ = "rank " + std::to_string(j) + " exited";
        throw std::runtime_error(
            std::string("fsharded shared-memory collectives: rank ") + std::to_string(j) + " (pid " +
            std::to_string(pid) + ") exited or died while rank " + std::to_string(rank_) +
            " waited for it to " + what + " " + op_name(desc_ >> 56) + " (round " + std::to_string(v) +
            " of segment " + name_ + ", after " + std::to_string(static_cast<int>(waited)) + " s)");
      }
      if (waited > timeout_s_) {
        fail(kTimeout, j, pid, waited, 0, 0, what);
        broken_why_ = "a timeout";
        throw std::runtime_error(
            std::string("fsharded shared-memory collectives: rank ") + std::to_string(rank_) +
            " waited " + std::to_string(static_cast<int>(waited)) + " s (the timeout) for rank " +
            std::to_string(j) + " to " + what + " " + op_name(desc_ >> 56) + " (round " +
            std::to_string(v) + " of segment " + name_ + "); rank " + std::to_string(j) +
            " is alive but did not arrive: it is stuck, or running other collectives (set "
            "FSHARDED_SHM=0 to use gloo's own transport)");
      }
    }
  }

  // Start round `round_ + 1`: returns this rank's slot of the round's buffer, once every rank
  // has left the round that last used it.
  char* begin_round() {
    ++round_;
    buf_ = static_cast<int>(round_ % 2);
    if (round_ > 2) {
      for (int64_t j = 0; j < world_; ++j) wait_ge(depart_at(j), round_ - 2, "finish", j);
    }
    return slot(buf_, rank_);
  }

  void arrive_and_wait(uint64_t desc) {
    Counter* me = arrive_at(rank_);
    desc_ = desc;
    me->desc[round_ % 2].store(desc, std::memory_order_relaxed);
    me->site[round_ % 2].store(site_, std::memory_order_relaxed);
    me->value.store(round_, std::memory_order_release);
    for (int64_t j = 0; j < world_; ++j) wait_ge(arrive_at(j), round_, "reach", j);
    // Rank j's description of this round: it cannot be overwritten before this rank departs.
    for (int64_t j = 0; j < world_; ++j) {
      const uint64_t theirs = arrive_at(j)->desc[round_ % 2].load(std::memory_order_relaxed);
      if (theirs != desc) {
        depart();  // let the others reach their own check
        fail(kOtherOp, j, 0, 0.0, theirs, arrive_at(j)->site[round_ % 2].load(std::memory_order_relaxed),
             "reach");
        broken_why_ = "the ranks called different collectives";
        throw std::runtime_error(
            std::string("fsharded shared-memory collectives: rank ") + std::to_string(rank_) +
            " called " + op_name(desc >> 56) + " of " + std::to_string(desc & ((uint64_t{1} << 48) - 1)) +
            " elements (" + dtype_name((desc >> 48) & 0xff) + ") while rank " +
            std::to_string(j) + " called " + op_name(theirs >> 56) + " of " +
            std::to_string(theirs & ((uint64_t{1} << 48) - 1)) + " elements (" +
            dtype_name((theirs >> 48) & 0xff) + "); every rank of a group must issue the "
            "same collectives in the same order");
      }
      const uint64_t where = arrive_at(j)->site[round_ % 2].load(std::memory_order_relaxed);
      if (where != site_) {
        depart();
        fail(kOtherSite, j, 0, 0.0, theirs, where, "reach");
        broken_why_ = "the ranks called collectives from different places";
        throw std::runtime_error(
            std::string("fsharded shared-memory collectives: rank ") + std::to_string(rank_) +
            " and rank " + std::to_string(j) + " both called " + op_name(desc >> 56) + " of " +
            std::to_string(desc & ((uint64_t{1} << 48) - 1)) + " elements, but from different "
            "places in the program (call-site fingerprints " + std::to_string(site_) + " and " +
            std::to_string(where) + "): a rank skipped or added a collective, so the results would "
            "be another collective's; every rank must issue the same collectives in the same order "
            "(FSHARDED_CHECK_SITES=0 turns this check off)");
      }
    }
  }

  void depart() { depart_at(rank_)->value.store(round_, std::memory_order_release); }

  // dst[0:c] <- reduction over ranks j (in rank order) of slot j's elements [at, at + c).
  void reduce_into(at::ScalarType dtype, char* dst, int64_t c, int64_t at, bool max,
                   double divisor) const {
    AT_DISPATCH_ALL_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "shm_reduce", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const bool divide = !max && divisor != 1.0;
      const acc_t d = static_cast<acc_t>(divisor);
      auto finish = [&](acc_t v) {
        return divide ? static_cast<scalar_t>(static_cast<acc_t>(static_cast<scalar_t>(v)) / d)
                      : static_cast<scalar_t>(v);
      };
      scalar_t* out = reinterpret_cast<scalar_t*>(dst);
      const scalar_t* s0 = reinterpret_cast<const scalar_t*>(slot(buf_, 0)) + at;
      if (world_ == 2 && !max) {
        const scalar_t* s1 = reinterpret_cast<const scalar_t*>(slot(buf_, 1)) + at;
        if (divide) {
          for (int64_t i = 0; i < c; ++i) out[i] = finish(static_cast<acc_t>(s0[i]) + static_cast<acc_t>(s1[i]));
        } else {
          for (int64_t i = 0; i < c; ++i) {
            out[i] = static_cast<scalar_t>(static_cast<acc_t>(s0[i]) + static_cast<acc_t>(s1[i]));
          }
        }
        return;
      }
      constexpr int64_t kTile = 1024;
      acc_t acc[kTile];
      for (int64_t i0 = 0; i0 < c; i0 += kTile) {
        const int64_t len = std::min(kTile, c - i0);
        for (int64_t i = 0; i < len; ++i) acc[i] = static_cast<acc_t>(s0[i0 + i]);
        for (int64_t j = 1; j < world_; ++j) {
          const scalar_t* sj = reinterpret_cast<const scalar_t*>(slot(buf_, j)) + at + i0;
          if (max) {
            for (int64_t i = 0; i < len; ++i) {
              acc_t v = static_cast<acc_t>(sj[i]);
              acc[i] = (v > acc[i] || v != v) ? v : acc[i];  // NaN propagates
            }
          } else {
            for (int64_t i = 0; i < len; ++i) acc[i] += static_cast<acc_t>(sj[i]);
          }
        }
        for (int64_t i = 0; i < len; ++i) out[i0 + i] = finish(acc[i]);
      }
    });
  }

  std::string name_;
  int64_t rank_, world_, slot_;
  double timeout_s_;
  size_t size_ = 0;
  char* base_ = nullptr;
  uint64_t round_ = 0;
  uint64_t desc_ = 0;  // the collective running (for messages)
  uint64_t site_ = 0;  // where it was called from
  int buf_ = 0;
  bool broken_ = false;
  std::string broken_why_;
  int64_t fail_kind_ = kNone, fail_peer_ = -1, fail_pid_ = 0;
  double fail_waited_ = 0.0;
  uint64_t fail_desc_ = 0, fail_site_ = 0;
  const char* fail_what_ = "";
  std::mutex mu_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fsharded: collectives between processes on one host over shared memory";
  py::class_<ShmComm>(m, "ShmComm")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, bool, double>(), py::arg("name"),
           py::arg("rank"), py::arg("world"), py::arg("slot_bytes"), py::arg("create"),
           py::arg("timeout_s"))
      .def("unlink", &ShmComm::unlink)
      .def("slot_bytes", &ShmComm::slot_bytes)
      .def("all_reduce_", &ShmComm::all_reduce_, py::arg("tensor"), py::arg("max") = false,
           py::arg("divisor") = 1.0, py::arg("site") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &ShmComm::all_gather, py::arg("input"), py::arg("output"),
           py::arg("site") = 0, py::arg("desc") = 0, py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter", &ShmComm::reduce_scatter, py::arg("input"), py::arg("output"),
           py::arg("site") = 0, py::call_guard<py::gil_scoped_release>())
      .def("all_to_all", &ShmComm::all_to_all, py::arg("input"), py::arg("output"),
           py::arg("site") = 0, py::call_guard<py::gil_scoped_release>())
      .def("barrier", &ShmComm::barrier, py::call_guard<py::gil_scoped_release>())
      .def("failure", &ShmComm::failure)
      .def("broken", &ShmComm::broken);
}
