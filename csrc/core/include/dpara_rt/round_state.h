#pragma once
// Per-request bookkeeping of speculative rounds (docs/design.md §1), over plain host arrays.
//
// Positions: after start(), request b has prompt_len committed tokens in the target's and the drafter's
// caches and one committed-but-uncached token, the prefill's next token, which is spine[0]. A round
// verifies the spine s_0..s_d = (last bonus, t_1..t_d) at positions target_pos .. target_pos + d; committing
// n tokens makes s_0..s_{n-1} cached, so target_pos and drafter_pos both advance by n and
// committed_len() == target_pos + 1 while a request runs.
#include <cstdint>
#include <vector>

#include "dpara_rt/types.h"

namespace dpara_rt {

class Metrics;

enum class FinishReason : std::uint8_t { none = 0, eos = 1, length = 2, max_len = 3, cancelled = 4 };
const char* finish_reason_name(FinishReason r);  // "", "eos", "length", "max_len", "cancelled"

// Greedy acceptance: r[b] = length of the longest prefix with draft[b][i] == target_argmax[b][i]
// (target_argmax[b][i] is the target's choice after s_0..s_i), bonus[b] = target_argmax[b][r[b]].
// draft: [batch, d], target_argmax: [batch, d+1], row-major.
void greedy_accept(int batch, int d, const std::int64_t* draft, const std::int64_t* target_argmax, std::int64_t* r,
                   std::int64_t* bonus);

// Spine+branch tree of one backbone forward. Query rows and keys are the same tree tokens, ordered spine
// rows 0..d first, then branch r's d rows for r = 0..d: rows() = (d+1) + (d+1)*d.
struct TreeMeta {
  int d = 0;
  std::vector<std::int32_t> query_branch;       // -1 for spine rows, r for branch r
  std::vector<std::int32_t> query_pos_offset;   // spine i: i; row j of branch r: r + 1 + j (from the spine start)
  std::vector<std::int32_t> query_spine_limit;  // last visible spine index: i for spine i, r for branch r
  std::vector<std::int32_t> key_spine;          // spine index of a spine key, -1 for branch keys
  std::vector<std::int32_t> key_branch;         // branch of a branch key, -1 for spine keys

  int rows() const { return (d + 1) * (d + 1); }
  // Spine row i sees spine 0..i; branch r sees spine 0..r and all of branch r (context is always visible).
  bool visible(int q, int k) const {
    return key_spine[std::size_t(k)] >= 0 ? key_spine[std::size_t(k)] <= query_spine_limit[std::size_t(q)]
                                          : key_branch[std::size_t(k)] == query_branch[std::size_t(q)];
  }
};
TreeMeta tree_meta(int d);  // std::invalid_argument unless 1 <= d <= kMaxDraft

class RoundState {
 public:
  // max_len: the KV-cache capacity in tokens (prompt + output never exceeds it).
  RoundState(int batch, int d, std::int64_t max_new_tokens, std::vector<std::int64_t> eos_ids, std::int64_t max_len);

  // Begin a generation: prompt_lens[b] tokens are cached; first_tokens[b] (the prefill's next token) is
  // committed and becomes spine[0]. committed_out[b] = 1 (0 only if that cannot happen).
  void start(const std::int64_t* prompt_lens, const std::int64_t* first_tokens, std::int64_t* committed_out);
  // The draft t_1..t_d that the next round verifies: spine[b][1..d] = draft[b] ([batch, d]).
  void set_draft(const std::int64_t* draft);
  // Continuous batching, between rounds: request b (a finished row) starts over as a new request whose
  // prompt_len tokens are cached and whose first token is committed, with its own max_new_tokens and stop
  // ids besides the shared EOS ids. Returns the tokens committed (1). retire(b) ends request b now.
  std::int64_t admit(int b, std::int64_t prompt_len, std::int64_t first_token, std::int64_t max_new_tokens,
                     std::vector<std::int64_t> stop_ids);
  void retire(int b);
  // Continuous batching: `batch` rows from now on (at least the current count); the new rows are free.
  void grow(int batch);
  // One fused round: greedy acceptance of the spine's draft against target_argmax [batch, d+1], then
  // commit(). Finished requests get r = 0, bonus = spine[0], committed = 0.
  void step(const std::int64_t* target_argmax, int slot, std::int64_t* r_out, std::int64_t* bonus_out,
            std::int64_t* committed_out);
  // Commit t_1..t_r and the bonus per request (from any verification rule), stopping exactly at an EOS id,
  // at max_new_tokens or at max_len even inside the block; then spine[0] = bonus, the positions advance
  // and `slot` (the ring slot of this round, -1 for none) joins each running request's history.
  void commit(const std::int64_t* r, const std::int64_t* bonus, int slot, std::int64_t* committed_out);
  // A verified round as an engine takes it, in one call (each separate call costs the per-round path microseconds
  // of interpreter time): `block` [batch, T] is what the target verified, s_0 then the draft (T = d + 1), or s_0
  // alone (T = 1: an AR round, with no draft, whose r must be 0). A greedy round gives target_argmax [batch, T]
  // (step()), any other the rule's r and bonus (commit()); pass null for what is not given. Requests that were
  // running record their acceptance in `metrics` (r, cut to what they committed); keep_out[b] = r + 1 for them
  // (the target's KV rows to keep), 0 for a request finished before the round, whose r_out is 0 and bonus_out s_0.
  void accept(const std::int64_t* block, int T, const std::int64_t* target_argmax, const std::int64_t* r,
              const std::int64_t* bonus, int slot, Metrics& metrics, std::int64_t* r_out, std::int64_t* bonus_out,
              std::int64_t* committed_out, std::int64_t* keep_out);

  int batch() const { return batch_; }
  int d() const { return d_; }
  std::int64_t max_new_tokens() const { return max_new_; }
  std::int64_t max_len() const { return max_len_; }
  const std::vector<std::int64_t>& eos_ids() const { return eos_; }
  const TreeMeta& tree() const { return tree_; }
  std::int64_t rounds() const { return rounds_; }
  bool started() const { return started_; }

  std::int64_t prompt_len(int b) const { return req(b).prompt_len; }
  std::int64_t committed_len(int b) const { return req(b).prompt_len + std::int64_t(req(b).output.size()); }
  std::int64_t target_pos(int b) const { return req(b).target_pos; }
  std::int64_t drafter_pos(int b) const { return req(b).drafter_pos; }
  bool finished(int b) const { return req(b).reason != FinishReason::none; }
  FinishReason reason(int b) const { return req(b).reason; }
  const std::vector<std::int64_t>& output(int b) const { return req(b).output; }
  const std::vector<std::int32_t>& slots(int b) const { return req(b).slots; }
  const std::int64_t* spine(int b) const { return &spine_[std::size_t(check_b(b)) * std::size_t(d_ + 1)]; }
  int num_running() const;

 private:
  struct Request {
    std::int64_t prompt_len = 0, target_pos = 0, drafter_pos = 0;
    FinishReason reason = FinishReason::none;
    std::int64_t max_new = 0;
    std::vector<std::int64_t> stop_ids;  // besides the shared eos_ids
    std::vector<std::int64_t> output;
    std::vector<std::int32_t> slots;
  };
  int check_b(int b) const;
  const Request& req(int b) const { return reqs_[std::size_t(check_b(b))]; }
  void require_started(const char* what) const;
  bool is_eos(const Request& q, std::int64_t tok) const;
  // Append one token; returns false once the request has stopped.
  bool append(Request& q, std::int64_t tok);
  void stop_if_no_room(Request& q);

  int batch_, d_;
  std::int64_t max_new_, max_len_;
  std::vector<std::int64_t> eos_;
  TreeMeta tree_;
  std::vector<Request> reqs_;
  std::vector<std::int64_t> spine_;  // [batch, d+1]
  std::vector<std::int64_t> scratch_r_, scratch_bonus_;
  std::int64_t rounds_ = 0;
  bool started_ = false, draft_set_ = false;
};

}  // namespace dpara_rt
