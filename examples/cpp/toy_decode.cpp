// A toy DPara decoding loop on the installed C++ core alone (no Python, no GPU): a target lane verifies
// each round's spine greedily while a drafter lane fills a boundary-ring slot for every acceptance length r
// at once; a Markov-head step then reads branch r and extends it from the bonus token into the next draft.
// Ring hand-offs go through lane events: mark_ready with the drafter's record(), select on the head's lane
// (the target lane, which waits for that event), release with the head's record().
//
// The toy model is a callback next(token, position). The drafter's boundary row for an input position q is
// a table over the vocabulary, row[v] = its guess of the token after v at q (wrong at some positions, so some
// drafts are rejected); the head indexes it with the previous token. The output must equal plain
// autoregressive greedy decoding of the model: the program checks that and exits 1 otherwise.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#include "dpara_rt/lane.h"
#include "dpara_rt/ring.h"
#include "dpara_rt/round_state.h"

using namespace dpara_rt;
using Tokens = std::vector<std::int64_t>;
using Model = std::int64_t (*)(std::int64_t token, std::int64_t pos);  // greedy next token after `token` at `pos`

namespace {

constexpr int kBatch = 2, kD = 4, kVocab = 32;
constexpr std::int64_t kMaxNew = 40, kMaxLen = 256, kEos = 0;

std::int64_t toy_target(std::int64_t token, std::int64_t pos) { return (3 * token + 5 * pos + 1) % kVocab; }

// The drafter: the model, except one position in seven where it guesses the next token instead.
std::int64_t toy_drafter(Model model, std::int64_t token, std::int64_t pos) {
  const std::int64_t t = model(token, pos);
  return pos % 7 == 3 ? (t + 1) % kVocab : t;
}

// Plain autoregressive greedy decoding: the reference.
Tokens decode_ar(Model model, const Tokens& prompt) {
  Tokens out;
  std::int64_t tok = prompt.back(), pos = std::int64_t(prompt.size()) - 1;
  while (std::int64_t(out.size()) < kMaxNew) {
    tok = model(tok, pos++);
    out.push_back(tok);
    if (tok == kEos) break;
  }
  return out;
}

class ToyDecoder {
 public:
  explicit ToyDecoder(Model model)
      : model_(model), ring_(2, kBatch, kD, kVocab, DType::float32), state_(kBatch, kD, kMaxNew, {kEos}, kMaxLen) {}

  std::vector<Tokens> decode(const std::vector<Tokens>& prompts) {
    Tokens lens(kBatch), first(kBatch), committed(kBatch);
    for (int b = 0; b < kBatch; ++b) {  // prefill: the prompt is cached, its next token is the first output
      lens[b] = std::int64_t(prompts[std::size_t(b)].size());
      first[b] = model_(prompts[std::size_t(b)].back(), lens[b] - 1);
    }
    state_.start(lens.data(), first.data(), committed.data());
    // The first draft: branch 0 of a slot drafted from one position back, extended from the first tokens.
    Tokens base(kBatch);
    for (int b = 0; b < kBatch; ++b) base[b] = state_.target_pos(b) - 1;
    const int slot0 = draft_slot(base);
    target_.submit([this, slot0, first] { head(slot0, Tokens(kBatch, 0), first); });
    target_.synchronize();
    while (state_.num_running() > 0) round();
    std::vector<Tokens> out;
    for (int b = 0; b < kBatch; ++b) out.push_back(state_.output(b));
    return out;
  }
  std::int64_t rounds() const { return state_.rounds(); }

 private:
  // One round: the drafter fills a slot for every branch while the target verifies, then the head.
  void round() {
    Tokens base(kBatch), spine;
    for (int b = 0; b < kBatch; ++b) {
      base[b] = state_.target_pos(b);
      spine.insert(spine.end(), state_.spine(b), state_.spine(b) + kD + 1);
    }
    const int slot = draft_slot(base);
    target_.submit([this, slot, base, spine] {
      Tokens argmax(spine.size()), r(kBatch), bonus(kBatch), committed(kBatch);
      for (int b = 0; b < kBatch; ++b)  // spine token i stands at position target_pos + i
        for (int i = 0; i <= kD; ++i) argmax[b * (kD + 1) + i] = model_(spine[b * (kD + 1) + i], base[b] + i);
      state_.step(argmax.data(), slot, r.data(), bonus.data(), committed.data());
      head(slot, r, bonus);
    });
    target_.synchronize();  // whether another round runs depends on this one's outcome
  }

  // Drafter lane: row j of branch r for request b stands at input position base[b] + r + 1 + j.
  int draft_slot(const Tokens& base) {
    const int slot = ring_.acquire(&drafter_);  // the drafter lane waits for the slot's release event
    float* rows = static_cast<float*>(ring_.slot_view(slot).data);
    drafter_.submit([this, rows, base] {
      for (int b = 0; b < kBatch; ++b)
        for (int r = 0; r <= kD; ++r)
          for (int j = 0; j < kD; ++j) {
            float* row = rows + ((std::int64_t(b) * (kD + 1) + r) * kD + j) * kVocab;
            for (int v = 0; v < kVocab; ++v) row[v] = float(toy_drafter(model_, v, base[b] + r + 1 + j));
          }
    });
    ring_.mark_ready(slot, drafter_.record());
    return slot;
  }

  // Head step, run as a task of the target lane: select branch r[b] (this task waits for the drafter's ready
  // event), extend it from the bonus into the next draft, release the slot with this lane's event.
  void head(int slot, const Tokens& r, const Tokens& bonus) {
    Tokens offsets(kBatch), draft(kBatch * kD);
    ring_.select(slot, r.data(), kBatch, offsets.data(), &target_);
    const float* ring = static_cast<const float*>(ring_.data());
    for (int b = 0; b < kBatch; ++b) {
      std::int64_t prev = bonus[b];
      for (int j = 0; j < kD; ++j) prev = draft[b * kD + j] = std::int64_t(ring[offsets[b] + j * kVocab + prev]);
    }
    ring_.release(slot, target_.record());
    state_.set_draft(draft.data());
  }

  Model model_;
  BoundaryRing ring_;
  RoundState state_;
  HostLane target_{"target"}, drafter_{"drafter"};  // declared last: drained before what their tasks use
};

void print(const char* what, int b, const Tokens& t) {
  std::printf("%s %d:", what, b);
  for (auto x : t) std::printf(" %lld", static_cast<long long>(x));
  std::printf("\n");
}

}  // namespace

int main() {
  try {
    const std::vector<Tokens> prompts{{1, 2, 3}, {7, 8, 9, 10, 11}};
    ToyDecoder dec(toy_target);
    const std::vector<Tokens> got = dec.decode(prompts);
    std::size_t tokens = 0;
    bool same = true;
    for (int b = 0; b < kBatch; ++b) {
      const Tokens want = decode_ar(toy_target, prompts[std::size_t(b)]);
      print("dpara", b, got[std::size_t(b)]);
      if (got[std::size_t(b)] != want) {
        print("   ar", b, want);
        same = false;
      }
      tokens += got[std::size_t(b)].size();
    }
    std::printf("%zu tokens in %lld rounds (d = %d); %s\n", tokens, static_cast<long long>(dec.rounds()), kD,
                same ? "identical to autoregressive decoding" : "MISMATCH with autoregressive decoding");
    return same ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "toy_decode: %s\n", e.what());
    return 2;
  }
}
