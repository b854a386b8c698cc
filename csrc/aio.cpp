// Asynchronous file I/O for the NVMe memory tier: a pool of threads running pread/pwrite.
//
// A request reads or writes one contiguous byte range of an open file into or from a
// caller's buffer. `submit` queues it and returns a ticket at once; `wait(ticket)` blocks
// (without the GIL) until a pool thread has done it, and returns the CRC-32C of its
// logical bytes: after the read for a read, before the write for a write, so that a caller
// that records the checksum of what it wrote can compare it with what it reads back.
//
// Files are opened with O_DIRECT where the filesystem allows it (the page cache is
// bypassed: the state does not come back into RAM as cache), else buffered. O_DIRECT needs
// the buffer address, the file offset and the size aligned to `kAlign`: buffers come from
// `aligned_empty`, and the caller rounds sizes up (files are padded to `kAlign`).
//
// Errors are never silent: a short read or write (a truncated file), ENOSPC (a full disk),
// or any other errno is raised by `wait` with the file's path, the offset and the sizes.
// `open_file` reserves a new file's bytes with posix_fallocate, so a disk too small for
// the state is an error when the tier is made, not in the middle of a step.

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fcntl.h>
#include <mutex>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <unordered_map>
#include <vector>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace {

constexpr int64_t kAlign = 4096;

// -- CRC-32C (Castagnoli), hardware where the CPU has SSE4.2 -----------------------------

uint32_t kTable[8][256];

void make_table() {
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    kTable[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int t = 1; t < 8; ++t) kTable[t][i] = (kTable[t - 1][i] >> 8) ^ kTable[0][kTable[t - 1][i] & 0xff];
}

uint32_t crc_soft(uint32_t crc, const uint8_t* p, size_t n) {
  crc = ~crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= crc;
    crc = kTable[7][v & 0xff] ^ kTable[6][(v >> 8) & 0xff] ^ kTable[5][(v >> 16) & 0xff] ^
          kTable[4][(v >> 24) & 0xff] ^ kTable[3][(v >> 32) & 0xff] ^ kTable[2][(v >> 40) & 0xff] ^
          kTable[1][(v >> 48) & 0xff] ^ kTable[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ kTable[0][(crc ^ *p++) & 0xff];
  return ~crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc_hw(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = ~crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}
#endif

bool have_hw() {
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  return hw;
#else
  return false;
#endif
}

uint32_t crc32c(const void* data, size_t n) {
  static std::once_flag once;
  std::call_once(once, make_table);
#if defined(__x86_64__)
  if (have_hw()) return crc_hw(0, static_cast<const uint8_t*>(data), n);
#endif
  return crc_soft(0, static_cast<const uint8_t*>(data), n);
}

// -- the pool ---------------------------------------------------------------------------------

struct Request {
  int fd = -1;
  int64_t offset = 0;
  char* buf = nullptr;
  int64_t io_bytes = 0;   // bytes read or written (aligned for O_DIRECT)
  int64_t logical = 0;    // bytes that hold data (checksummed; a read must get at least these)
  bool write = false;
  bool checksum = true;
  uint32_t crc = 0;
  std::string error;
  bool done = false;
  at::Tensor keep;  // the buffer, alive until the request is waited for
};

std::string path_of(int fd);

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int64_t submit(Request r) {
    std::lock_guard<std::mutex> g(mu_);
    int64_t ticket = next_++;
    requests_[ticket] = std::move(r);
    queue_.push_back(ticket);
    cv_.notify_one();
    return ticket;
  }
  // Blocks until the request is done; returns it (and forgets it).
  Request wait(int64_t ticket) {
    std::unique_lock<std::mutex> g(mu_);
    auto it = requests_.find(ticket);
    if (it == requests_.end()) throw std::runtime_error("aio: unknown or already waited ticket " + std::to_string(ticket));
    done_cv_.wait(g, [&] { return requests_[ticket].done; });
    Request r = std::move(requests_[ticket]);
    requests_.erase(ticket);
    return r;
  }
  size_t size() const { return workers_.size(); }

 private:
  void loop() {
    for (;;) {
      int64_t ticket;
      Request* r;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty()) return;
        ticket = queue_.front();
        queue_.pop_front();
        r = &requests_[ticket];  // (unordered_map nodes do not move)
      }
      run(*r);
      {
        std::lock_guard<std::mutex> g(mu_);
        r->done = true;
      }
      done_cv_.notify_all();
    }
  }
  static void run(Request& r) {
    if (r.write && r.checksum) r.crc = crc32c(r.buf, static_cast<size_t>(r.logical));
    int64_t got = 0;
    while (got < r.io_bytes) {
      ssize_t k = r.write ? ::pwrite(r.fd, r.buf + got, static_cast<size_t>(r.io_bytes - got), r.offset + got)
                          : ::pread(r.fd, r.buf + got, static_cast<size_t>(r.io_bytes - got), r.offset + got);
      if (k < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        r.error = std::string(r.write ? "writing " : "reading ") + std::to_string(r.io_bytes) + " bytes at offset " +
                  std::to_string(r.offset) + " of " + path_of(r.fd) + ": " + std::strerror(e) +
                  (e == ENOSPC ? " (the disk is full)" : "");
        return;
      }
      if (k == 0) break;  // end of file
      got += k;
    }
    if (got < (r.write ? r.io_bytes : r.logical)) {
      r.error = std::string(r.write ? "short write: " : "short read: ") + std::to_string(got) + " of " +
                std::to_string(r.write ? r.io_bytes : r.logical) + " bytes at offset " + std::to_string(r.offset) +
                " of " + path_of(r.fd) + (r.write ? "" : " (the file is shorter than the state it holds: truncated?)");
      return;
    }
    if (!r.write && r.checksum) r.crc = crc32c(r.buf, static_cast<size_t>(r.logical));
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<int64_t> queue_;
  std::unordered_map<int64_t, Request> requests_;
  int64_t next_ = 0;
  bool stop_ = false;
};

std::mutex g_mu;
std::unique_ptr<Pool> g_pool;
std::unordered_map<int, std::string> g_paths;

std::string path_of(int fd) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_paths.find(fd);
  return it == g_paths.end() ? "fd " + std::to_string(fd) : it->second;
}

Pool& pool() {
  std::lock_guard<std::mutex> g(g_mu);
  if (!g_pool) g_pool = std::make_unique<Pool>(4);
  return *g_pool;
}

}  // namespace

// Start (or restart) the pool with `threads` threads; outstanding requests must be waited first.
void set_threads(int64_t threads) {
  TORCH_CHECK(threads >= 1 && threads <= 256, "aio: threads must be in [1, 256], got ", threads);
  std::lock_guard<std::mutex> g(g_mu);
  g_pool = std::make_unique<Pool>(static_cast<int>(threads));
}

int64_t threads() { return static_cast<int64_t>(pool().size()); }

int64_t alignment() { return kAlign; }

// Open `path` for reading and writing. `create`: a new file of `nbytes` (rounded up to the
// alignment), its blocks reserved (posix_fallocate: ENOSPC here, not in a step). `direct`:
// try O_DIRECT, falling back to buffered I/O where the filesystem refuses it. Returns
// (fd, whether O_DIRECT is on).
std::tuple<int64_t, bool> open_file(const std::string& path, int64_t nbytes, bool create, bool direct) {
  int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_TRUNC : 0);
  int fd = -1;
  bool on = false;
#ifdef O_DIRECT
  if (direct) {
    fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
    on = fd >= 0;
  }
#endif
  if (fd < 0) fd = ::open(path.c_str(), flags, 0600);
  if (fd < 0) {
    int e = errno;
    throw std::runtime_error("aio: cannot open " + path + ": " + std::strerror(e));
  }
  if (create) {
    int64_t padded = (nbytes + kAlign - 1) / kAlign * kAlign;
    if (padded > 0) {
      int e = ::posix_fallocate(fd, 0, padded);
      if (e == EOPNOTSUPP || e == EINVAL) e = ::ftruncate(fd, padded) == 0 ? 0 : errno;
      if (e != 0) {
        ::close(fd);
        ::unlink(path.c_str());
        throw std::runtime_error("aio: cannot reserve " + std::to_string(padded) + " bytes for " + path + ": " +
                                 std::strerror(e) + (e == ENOSPC ? " (the disk is full)" : ""));
      }
    }
  } else {
    struct stat st;
    if (::fstat(fd, &st) == 0 && st.st_size < nbytes) {
      ::close(fd);
      throw std::runtime_error("aio: " + path + " holds " + std::to_string(st.st_size) + " bytes, " +
                               std::to_string(nbytes) + " expected (truncated?)");
    }
  }
  std::lock_guard<std::mutex> g(g_mu);
  g_paths[fd] = path;
  return {fd, on};
}

void close_file(int64_t fd) {
  {
    std::lock_guard<std::mutex> g(g_mu);
    g_paths.erase(static_cast<int>(fd));
  }
  ::close(static_cast<int>(fd));
}

// A byte tensor of `nbytes` (rounded up to the alignment) whose address is aligned for O_DIRECT.
at::Tensor aligned_empty(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "aio: negative size");
  int64_t padded = std::max<int64_t>(kAlign, (nbytes + kAlign - 1) / kAlign * kAlign);
  void* p = nullptr;
  if (::posix_memalign(&p, kAlign, static_cast<size_t>(padded)) != 0) throw std::bad_alloc();
  return at::from_blob(p, {padded}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
}

// Queue a read (write=false) or a write of `io_bytes` at `offset` of `fd` into or from
// `buf` (contiguous CPU; kept alive until waited for); `logical` <= io_bytes are checksummed.
int64_t submit(int64_t fd, int64_t offset, at::Tensor buf, int64_t io_bytes, int64_t logical, bool write,
               bool checksum) {
  TORCH_CHECK(buf.device().is_cpu() && buf.is_contiguous(), "aio: buffers must be contiguous CPU tensors");
  int64_t have = buf.numel() * buf.element_size();
  TORCH_CHECK(io_bytes >= 0 && logical >= 0 && logical <= io_bytes && io_bytes <= have, "aio: ", io_bytes,
              " bytes (", logical, " of data) do not fit a buffer of ", have, " bytes");
  Request r;
  r.fd = static_cast<int>(fd);
  r.offset = offset;
  r.buf = static_cast<char*>(buf.data_ptr());
  r.io_bytes = io_bytes;
  r.logical = logical;
  r.write = write;
  r.checksum = checksum;
  r.keep = buf;
  return pool().submit(std::move(r));
}

// Wait for a request: its CRC-32C (0 without checksum), or the error it met, raised.
int64_t wait(int64_t ticket) {
  Request r;
  {
    pybind11::gil_scoped_release nogil;
    r = pool().wait(ticket);
  }
  if (!r.error.empty()) throw std::runtime_error("aio: " + r.error);
  return static_cast<int64_t>(r.crc);
}

int64_t checksum(at::Tensor t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "aio.checksum: a contiguous CPU tensor");
  return static_cast<int64_t>(crc32c(t.data_ptr(), static_cast<size_t>(t.numel() * t.element_size())));
}

// Flush a file's data to the device (fdatasync) and drop its pages from the page cache.
void sync_file(int64_t fd, bool drop) {
  if (::fdatasync(static_cast<int>(fd)) != 0) {
    int e = errno;
    throw std::runtime_error("aio: fdatasync of " + path_of(static_cast<int>(fd)) + ": " + std::strerror(e));
  }
#ifdef POSIX_FADV_DONTNEED
  if (drop) ::posix_fadvise(static_cast<int>(fd), 0, 0, POSIX_FADV_DONTNEED);
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_threads", &set_threads);
  m.def("threads", &threads);
  m.def("alignment", &alignment);
  m.def("open_file", &open_file);
  m.def("close_file", &close_file);
  m.def("aligned_empty", &aligned_empty);
  m.def("submit", &submit);
  m.def("wait", &wait);
  m.def("checksum", &checksum);
  m.def("sync_file", &sync_file);
  m.def("hardware_crc", &have_hw);
}
