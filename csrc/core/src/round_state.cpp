#include "dpara_rt/round_state.h"

#include <algorithm>

#include "dpara_rt/metrics.h"
#include "util.h"

namespace dpara_rt {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::none: return "";
    case FinishReason::eos: return "eos";
    case FinishReason::length: return "length";
    case FinishReason::max_len: return "max_len";
    case FinishReason::cancelled: return "cancelled";
  }
  return "?";
}

void greedy_accept(int batch, int d, const std::int64_t* draft, const std::int64_t* target_argmax, std::int64_t* r,
                   std::int64_t* bonus) {
  for (int b = 0; b < batch; ++b) {
    const std::int64_t* t = draft + std::size_t(b) * std::size_t(d);
    const std::int64_t* p = target_argmax + std::size_t(b) * std::size_t(d + 1);
    int k = 0;
    while (k < d && t[k] == p[k]) ++k;
    r[b] = k;
    bonus[b] = p[k];
  }
}

TreeMeta tree_meta(int d) {
  detail::check_draft_length(d, "tree");
  TreeMeta m;
  m.d = d;
  const std::size_t rows = std::size_t(m.rows());
  for (auto* v : {&m.query_branch, &m.query_pos_offset, &m.query_spine_limit, &m.key_spine, &m.key_branch})
    v->reserve(rows);
  for (int i = 0; i <= d; ++i) {  // spine s_0..s_d
    m.query_branch.push_back(-1);
    m.query_pos_offset.push_back(i);
    m.query_spine_limit.push_back(i);
    m.key_spine.push_back(i);
    m.key_branch.push_back(-1);
  }
  for (int r = 0; r <= d; ++r) {  // branch r: its first row stands where the unknown bonus will be
    for (int j = 0; j < d; ++j) {
      m.query_branch.push_back(r);
      m.query_pos_offset.push_back(r + 1 + j);
      m.query_spine_limit.push_back(r);
      m.key_spine.push_back(-1);
      m.key_branch.push_back(r);
    }
  }
  return m;
}

RoundState::RoundState(int batch, int d, std::int64_t max_new_tokens, std::vector<std::int64_t> eos_ids,
                       std::int64_t max_len)
    : batch_(batch), d_(d), max_new_(max_new_tokens), max_len_(max_len), eos_(std::move(eos_ids)) {
  if (batch < 1) detail::value_error("round-state batch must be >= 1, got ", batch);
  if (max_new_tokens < 1) detail::value_error("max_new_tokens must be >= 1, got ", max_new_tokens);
  if (max_len < 2) detail::value_error("max_len must be >= 2 (one prompt token and one new token), got ", max_len);
  for (auto e : eos_)
    if (e < 0) detail::value_error("EOS id must be a token id >= 0, got ", e);
  tree_ = tree_meta(d);  // validates d
  reqs_.resize(std::size_t(batch));
  spine_.assign(std::size_t(batch) * std::size_t(d + 1), 0);
  scratch_r_.resize(std::size_t(batch));
  scratch_bonus_.resize(std::size_t(batch));
}

int RoundState::check_b(int b) const {
  if (b < 0 || b >= batch_) detail::value_error("request index ", b, " out of range for batch ", batch_);
  return b;
}

void RoundState::require_started(const char* what) const {
  if (!started_) detail::runtime_error(what, " before start(): no generation is running");
}

int RoundState::num_running() const {
  return int(std::count_if(reqs_.begin(), reqs_.end(), [](const Request& q) { return q.reason == FinishReason::none; }));
}

bool RoundState::is_eos(const Request& q, std::int64_t tok) const {
  return std::find(eos_.begin(), eos_.end(), tok) != eos_.end() ||
         std::find(q.stop_ids.begin(), q.stop_ids.end(), tok) != q.stop_ids.end();
}

bool RoundState::append(Request& q, std::int64_t tok) {
  q.output.push_back(tok);
  if (is_eos(q, tok)) q.reason = FinishReason::eos;
  else if (std::int64_t(q.output.size()) >= q.max_new) q.reason = FinishReason::length;
  else if (q.prompt_len + std::int64_t(q.output.size()) >= max_len_) q.reason = FinishReason::max_len;
  return q.reason == FinishReason::none;
}

void RoundState::stop_if_no_room(Request& q) {
  // The next verify writes d+1 rows from target_pos on; a request whose rows no longer fit the cache stops.
  if (q.reason == FinishReason::none && q.target_pos + d_ + 1 > max_len_) q.reason = FinishReason::max_len;
}

void RoundState::start(const std::int64_t* prompt_lens, const std::int64_t* first_tokens, std::int64_t* committed_out) {
  for (int b = 0; b < batch_; ++b) {
    if (prompt_lens[b] < 1 || prompt_lens[b] >= max_len_)
      detail::value_error("prompt length ", prompt_lens[b], " of request ", b, " must be in 1..", max_len_ - 1,
                          " (max_len ", max_len_, ")");
    if (first_tokens[b] < 0) detail::value_error("first token ", first_tokens[b], " of request ", b, " is not a token id");
  }
  for (int b = 0; b < batch_; ++b) {
    Request& q = reqs_[std::size_t(b)];
    q = Request{};
    q.max_new = max_new_;
    q.prompt_len = q.target_pos = q.drafter_pos = prompt_lens[b];
    std::int64_t* s = &spine_[std::size_t(b) * std::size_t(d_ + 1)];
    std::fill(s, s + d_ + 1, std::int64_t(0));
    s[0] = first_tokens[b];
    if (append(q, first_tokens[b])) stop_if_no_room(q);
    committed_out[b] = 1;
  }
  rounds_ = 0;
  started_ = true;
  draft_set_ = false;
}

std::int64_t RoundState::admit(int b, std::int64_t prompt_len, std::int64_t first_token, std::int64_t max_new_tokens,
                               std::vector<std::int64_t> stop_ids) {
  require_started("admit");
  check_b(b);
  if (reqs_[std::size_t(b)].reason == FinishReason::none)
    detail::value_error("cannot admit a request into row ", b, ": its request is still running");
  if (prompt_len < 1 || prompt_len >= max_len_)
    detail::value_error("prompt length ", prompt_len, " of row ", b, " must be in 1..", max_len_ - 1, " (max_len ",
                        max_len_, ")");
  if (first_token < 0) detail::value_error("first token ", first_token, " of row ", b, " is not a token id");
  if (max_new_tokens < 1) detail::value_error("max_new_tokens ", max_new_tokens, " of row ", b, " must be >= 1");
  Request& q = reqs_[std::size_t(b)];
  q = Request{};
  q.max_new = max_new_tokens;
  q.stop_ids = std::move(stop_ids);
  q.prompt_len = q.target_pos = q.drafter_pos = prompt_len;
  std::int64_t* s = &spine_[std::size_t(b) * std::size_t(d_ + 1)];
  std::fill(s, s + d_ + 1, std::int64_t(0));
  s[0] = first_token;
  if (append(q, first_token)) stop_if_no_room(q);
  return 1;
}

void RoundState::retire(int b) {
  require_started("retire");
  Request& q = reqs_[std::size_t(check_b(b))];
  if (q.reason == FinishReason::none) q.reason = FinishReason::cancelled;
}

void RoundState::grow(int batch) {
  require_started("grow");
  if (batch < batch_) detail::value_error("grow to ", batch, " rows: expected at least the current ", batch_);
  Request free_row;
  free_row.reason = FinishReason::cancelled;
  reqs_.resize(std::size_t(batch), free_row);
  spine_.resize(std::size_t(batch) * std::size_t(d_ + 1), 0);
  scratch_r_.resize(std::size_t(batch));
  scratch_bonus_.resize(std::size_t(batch));
  batch_ = batch;
}

void RoundState::set_draft(const std::int64_t* draft) {
  require_started("set_draft");
  for (int b = 0; b < batch_; ++b) {
    std::int64_t* s = &spine_[std::size_t(b) * std::size_t(d_ + 1)];
    const std::int64_t* t = draft + std::size_t(b) * std::size_t(d_);
    for (int j = 0; j < d_; ++j) {
      // Finished requests keep running through the batched forward; their rows are ignored.
      if (t[j] < 0 && reqs_[std::size_t(b)].reason == FinishReason::none)
        detail::value_error("draft[", b, "][", j, "] = ", t[j], " is not a token id");
      s[j + 1] = t[j];
    }
  }
  draft_set_ = true;
}

void RoundState::step(const std::int64_t* target_argmax, int slot, std::int64_t* r_out, std::int64_t* bonus_out,
                      std::int64_t* committed_out) {
  require_started("step");
  if (!draft_set_) detail::runtime_error("step before set_draft: the spine of round ", rounds_, " has no draft tokens");
  for (int b = 0; b < batch_; ++b) {
    const std::int64_t* s = &spine_[std::size_t(b) * std::size_t(d_ + 1)];
    const std::int64_t* p = target_argmax + std::size_t(b) * std::size_t(d_ + 1);
    int k = 0;
    while (k < d_ && s[k + 1] == p[k]) ++k;
    r_out[b] = k;
    bonus_out[b] = p[k];
  }
  commit(r_out, bonus_out, slot, committed_out);
  // Report what was taken: finished rows accepted nothing and keep their spine head as the bonus.
  for (int b = 0; b < batch_; ++b)
    if (committed_out[b] == 0) {
      r_out[b] = 0;
      bonus_out[b] = spine_[std::size_t(b) * std::size_t(d_ + 1)];
    }
}

void RoundState::accept(const std::int64_t* block, int T, const std::int64_t* target_argmax, const std::int64_t* r,
                        const std::int64_t* bonus, int slot, Metrics& metrics, std::int64_t* r_out,
                        std::int64_t* bonus_out, std::int64_t* committed_out, std::int64_t* keep_out) {
  require_started("accept");
  if (T != d_ + 1 && T != 1)
    detail::value_error("accept: blocks of T = ", T, " tokens, expected d + 1 = ", d_ + 1, " or 1 (an AR round)");
  if ((target_argmax != nullptr) == (r != nullptr && bonus != nullptr) || (r == nullptr) != (bonus == nullptr))
    detail::value_error("accept: expected target_argmax (a greedy round) or r and bonus (any rule), got ",
                        target_argmax ? "target_argmax" : "no target_argmax", r ? ", r" : "", bonus ? ", bonus" : "");
  if (target_argmax != nullptr && T == 1)
    detail::value_error("accept: target_argmax for an AR round (T = 1), expected its bonus as r = 0 and bonus");
  thread_local std::vector<std::int64_t> draft;
  thread_local std::vector<char> ran;
  draft.assign(std::size_t(batch_) * std::size_t(d_), 0);
  ran.resize(std::size_t(batch_));
  for (int b = 0; b < batch_; ++b) {
    ran[std::size_t(b)] = reqs_[std::size_t(b)].reason == FinishReason::none;
    if (T == 1 && ran[std::size_t(b)] && r[b] != 0)
      detail::value_error("accept: r[", b, "] = ", r[b], " in an AR round (T = 1), expected 0");
    for (int j = 0; j + 1 < T; ++j)
      draft[std::size_t(b) * std::size_t(d_) + std::size_t(j)] = block[std::size_t(b) * std::size_t(T) + 1 + j];
  }
  set_draft(draft.data());
  if (target_argmax != nullptr) {
    step(target_argmax, slot, r_out, bonus_out, committed_out);
  } else {
    std::copy(r, r + batch_, r_out);
    std::copy(bonus, bonus + batch_, bonus_out);
    commit(r_out, bonus_out, slot, committed_out);
  }
  thread_local std::vector<std::int64_t> accepted;
  accepted.clear();
  for (int b = 0; b < batch_; ++b) {
    if (ran[std::size_t(b)]) {
      accepted.push_back(std::min(r_out[b], committed_out[b] - 1));  // a round cut by EOS kept only what it committed
      keep_out[b] = r_out[b] + 1;
    } else {
      r_out[b] = keep_out[b] = 0;
      bonus_out[b] = block[std::size_t(b) * std::size_t(T)];  // it stays s_0 in the batched forwards
    }
  }
  metrics.record_round(accepted.data(), std::int64_t(accepted.size()));
}

void RoundState::commit(const std::int64_t* r, const std::int64_t* bonus, int slot, std::int64_t* committed_out) {
  require_started("commit");
  if (!draft_set_) detail::runtime_error("commit before set_draft: the spine of round ", rounds_, " has no draft tokens");
  for (int b = 0; b < batch_; ++b) {
    if (reqs_[std::size_t(b)].reason != FinishReason::none) continue;
    if (r[b] < 0 || r[b] > d_) detail::value_error("r[", b, "] = ", r[b], " out of range: expected 0..", d_);
    if (bonus[b] < 0) detail::value_error("bonus[", b, "] = ", bonus[b], " is not a token id");
  }
  for (int b = 0; b < batch_; ++b) {
    Request& q = reqs_[std::size_t(b)];
    committed_out[b] = 0;
    if (q.reason != FinishReason::none) continue;
    std::int64_t* s = &spine_[std::size_t(b) * std::size_t(d_ + 1)];
    std::int64_t n = 0;
    bool running = true;
    for (std::int64_t i = 1; i <= r[b] && running; ++i, ++n) running = append(q, s[i]);
    if (running) {
      append(q, bonus[b]);
      ++n;
    }
    committed_out[b] = n;
    q.target_pos += n;
    q.drafter_pos += n;
    q.slots.push_back(slot);
    s[0] = bonus[b];
    stop_if_no_room(q);
  }
  ++rounds_;
  draft_set_ = false;
}

}  // namespace dpara_rt
