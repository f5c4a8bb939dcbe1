// The ring all-reduce's walk (comm/patterns.py `_ring`) for a caller that does not read flows:
// the same posts, waits and rank-order reduction, in C++ with the GIL released, so that a rank's
// next send waits for gloo and not for the interpreter (8 ranks sharing 2 cores: docs/design.md).
// Python builds the plan (native_ring.py); this file only executes it. Every wait is bounded by
// one deadline; any failure throws std::runtime_error naming the step, the peer and gloo's error.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using Work = c10::intrusive_ptr<c10d::Work>;

template <typename Group>  // a ProcessGroup, or a backend such as ProcessGroupGloo: both send and recv alike
struct Walk {
  c10::intrusive_ptr<Group> pg;
  at::Tensor flat;               // the tensor being reduced, 1-D
  std::vector<at::Tensor> rows;  // rows[src]: src's raw rows for my chunk (empty for me)
  int64_t lo, me, seq_bits;
  Clock::time_point deadline;
  std::vector<Work> recv_works;
  std::vector<bool> recv_waited;
  std::vector<int64_t> recv_peer;

  at::Tensor bytes(const at::Tensor& t, int64_t a, int64_t z) const {
    return t.narrow(0, a, z - a).view(at::kByte);
  }

  // the error Transport.wait_native parses: outcome|send or recv|peer|step|gloo's first line
  [[noreturn]] static void fail(bool late, bool send, int64_t peer, const std::string& step, const std::exception& e) {
    std::string msg(e.what());
    throw std::runtime_error(std::string(late ? "deadline|" : "failed|") + (send ? "send|" : "recv|") +
                             std::to_string(peer) + "|" + step + "|" +
                             msg.substr(0, std::min<size_t>(200, msg.find('\n'))));
  }

  void wait(Work& w, bool send, const char* what, int64_t peer, int64_t index) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() < 1) left = std::chrono::milliseconds(1);
    try {
      w->wait(left);
    } catch (const std::exception& e) {
      fail(Clock::now() >= deadline, send, peer, std::string(what) + " " + std::to_string(index), e);
    }
  }

  Work post(bool send, at::Tensor t, int64_t peer, int64_t tag) {
    std::vector<at::Tensor> v{t};
    int t32 = static_cast<int>(seq_bits | tag);
    try {  // a closed link fails at issue
      return send ? pg->send(v, static_cast<int>(peer), t32) : pg->recv(v, static_cast<int>(peer), t32);
    } catch (const std::exception& e) {
      fail(false, send, peer, "post", e);
    }
  }

  // flat[a:z] = ((0 + x_0) + x_1) + ... + x_{N-1}, x_r = rank r's rows (mine: flat itself), element
  // by element: one pass over the rows for the types summed here (the same adds in the same order as
  // torch's zeros + add_ per rank, so the same bits), torch's ops for the others (half types round
  // at every add inside torch's kernel).
  void reduce(int64_t a, int64_t z) {
    switch (flat.scalar_type()) {
      case at::kFloat: return reduce_as<float, float>(a, z);
      case at::kDouble: return reduce_as<double, double>(a, z);
      case at::kLong: return reduce_as<int64_t, uint64_t>(a, z);  // unsigned: wrapping is defined, the
      case at::kInt: return reduce_as<int32_t, uint32_t>(a, z);   // bits are two's complement's
      default: break;
    }
    at::Tensor acc = at::zeros({z - a}, flat.options());
    for (size_t r = 0; r < rows.size(); ++r) acc.add_(row(static_cast<int64_t>(r), a, z));
    flat.narrow(0, a, z - a).copy_(acc);
  }

  at::Tensor row(int64_t r, int64_t a, int64_t z) const {
    return r == me ? flat.narrow(0, a, z - a) : rows[r].narrow(0, a - lo, z - a);
  }

  // Blocks small enough for the sums to stay in L1: each row is read once, the piece written once
  // (flat[a:z] is also my row: a block is read whole before it is written). T is the tensor's type,
  // A the one added in (T itself, or for integers its unsigned twin, same size and bits).
  template <typename T, typename A>
  void reduce_as(int64_t a, int64_t z) {
    static_assert(sizeof(T) == sizeof(A), "the sums are the tensor's bits");
    constexpr int64_t kBlock = 2048;
    T* mine = flat.template data_ptr<T>() + a;  // pointers, not narrowed tensors: no allocation per row
    std::vector<const A*> src;
    for (size_t r = 0; r < rows.size(); ++r)
      src.push_back(reinterpret_cast<const A*>(static_cast<int64_t>(r) == me ? mine
                                                                               : rows[r].template data_ptr<T>() + (a - lo)));
    A* out = reinterpret_cast<A*>(mine);
    A acc[kBlock];
    for (int64_t base = 0; base < z - a; base += kBlock) {
      const int64_t m = std::min(kBlock, z - a - base);
      std::fill(acc, acc + m, A(0));
      for (const A* x : src)
        for (int64_t j = 0; j < m; ++j) acc[j] += x[base + j];
      std::copy(acc, acc + m, out + base);
    }
  }

  void wait_recv(int64_t i, const char* what) {
    if (recv_waited[i]) return;
    wait(recv_works[i], false, what, recv_peer[i], i);
    recv_waited[i] = true;
  }
};

// recvs: [src, into_rows (1) or flat (0), a, z, tag] in posting order.
// pre_sends: [peer, a, z, tag], posted at once before the walk (an unpaced ring's rows).
// steps: [kind (0 own, 1 fwd, 2 rows), peer, a, z, tag, first, last) with waits[first:last] the
// receives a step needs (its piece's rows for `own`, the piece itself for `fwd`); `window` sends in
// flight at most. `order` is the rank order of the reduction: rows[r] for r != me, flat for me.
template <typename Group>
void walk_ring(const c10::intrusive_ptr<Group>& pg, at::Tensor flat, std::vector<at::Tensor> rows,
               int64_t lo, int64_t me, int64_t seq_bits, const std::vector<std::vector<int64_t>>& recvs,
               const std::vector<std::vector<int64_t>>& pre_sends, const std::vector<std::vector<int64_t>>& steps,
               const std::vector<int64_t>& waits, int64_t window, double timeout_s) {
  pybind11::gil_scoped_release nogil;
  Walk<Group> w{pg, flat, std::move(rows), lo, me, seq_bits,
         Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000))};
  for (const auto& r : recvs) {
    at::Tensor into = r[1] ? w.bytes(w.rows[r[0]], r[2] - lo, r[3] - lo) : w.bytes(flat, r[2], r[3]);
    w.recv_works.push_back(w.post(false, into, r[0], r[4]));
    w.recv_peer.push_back(r[0]);
  }
  w.recv_waited.assign(w.recv_works.size(), false);
  std::vector<Work> pre, sends;
  std::vector<int64_t> send_peer;
  for (const auto& s : pre_sends) pre.push_back(w.post(true, w.bytes(flat, s[1], s[2]), s[0], s[3]));
  size_t waited = 0;
  for (const auto& s : steps) {
    if (static_cast<int64_t>(sends.size() - waited) >= window) {
      w.wait(sends[waited], true, "send of the ring", send_peer[waited], static_cast<int64_t>(waited));
      ++waited;
    }
    int64_t kind = s[0], a = s[2], z = s[3];
    if (kind == 0) {  // my piece: every rank's rows are in; reduce in rank order into a zero buffer
      for (int64_t k = s[5]; k < s[6]; ++k) w.wait_recv(waits[k], "reduce-scatter piece");
      w.reduce(a, z);
    } else if (kind == 1) {
      for (int64_t k = s[5]; k < s[6]; ++k) w.wait_recv(waits[k], "all-gather piece");
    }
    sends.push_back(w.post(true, w.bytes(flat, a, z), s[1], s[4]));
    send_peer.push_back(s[1]);
  }
  for (size_t i = 0; i < pre.size(); ++i) w.wait(pre[i], true, "rows sent", pre_sends[i][0], static_cast<int64_t>(i));
  for (size_t i = waited; i < sends.size(); ++i)
    w.wait(sends[i], true, "send of the ring", send_peer[i], static_cast<int64_t>(i));
  for (size_t i = 0; i < w.recv_works.size(); ++i) w.wait_recv(static_cast<int64_t>(i), "all-gather");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("walk_ring", &walk_ring<c10d::ProcessGroup>, "the ring all-reduce's walk, GIL released (native_ring.py)");
  m.def("walk_ring", &walk_ring<c10d::Backend>, "the same on a backend's own group (ProcessGroupGloo)");
}
