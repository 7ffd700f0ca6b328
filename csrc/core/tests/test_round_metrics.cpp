// Round state (acceptance, commits with EOS / max_new_tokens / max_len), tree metadata and metrics.
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "dpara_rt/metrics.h"
#include "dpara_rt/ring.h"
#include "dpara_rt/round_state.h"
#include "dpara_rt/staging.h"

using namespace dpara_rt;
using V = std::vector<std::int64_t>;

static void test_greedy_accept() {
  // d = 3; request 0 accepts 2, request 1 none, request 2 all.
  V draft{5, 6, 7, 1, 2, 3, 9, 9, 9}, argmax{5, 6, 0, 8, 4, 4, 4, 4, 9, 9, 9, 11}, r(3), bonus(3);
  greedy_accept(3, 3, draft.data(), argmax.data(), r.data(), bonus.data());
  CHECK((r == V{2, 0, 3}));
  CHECK((bonus == V{0, 4, 11}));
}

// A running batch of one, d = 4, prompt of 10 tokens, first token 100.
static RoundState started(std::int64_t max_new, V eos, std::int64_t max_len) {
  RoundState st(1, 4, max_new, std::move(eos), max_len);
  V p{10}, first{100}, c(1);
  st.start(p.data(), first.data(), c.data());
  CHECK(c[0] == 1);
  return st;
}

static void test_commit_full_block() {
  RoundState st = started(100, {2}, 1000);
  V draft{11, 12, 13, 14}, argmax{11, 12, 13, 14, 15}, r(1), b(1), c(1);
  st.set_draft(draft.data());
  st.step(argmax.data(), 3, r.data(), b.data(), c.data());
  CHECK(r[0] == 4 && b[0] == 15 && c[0] == 5);
  CHECK((st.output(0) == V{100, 11, 12, 13, 14, 15}));
  CHECK(st.target_pos(0) == 15 && st.drafter_pos(0) == 15 && st.committed_len(0) == 16);
  CHECK(st.spine(0)[0] == 15);
  CHECK(st.slots(0) == std::vector<std::int32_t>{3});
  CHECK(!st.finished(0));
  CHECK_THROWS(st.step(argmax.data(), 0, r.data(), b.data(), c.data()), std::runtime_error, "before set_draft");
}

static void test_eos_mid_block() {
  RoundState st = started(100, {2, 7}, 1000);
  V draft{11, 7, 13, 14}, argmax{11, 7, 13, 0, 0}, r(1), b(1), c(1);
  st.set_draft(draft.data());
  st.step(argmax.data(), 0, r.data(), b.data(), c.data());
  CHECK(r[0] == 3);
  CHECK(c[0] == 2);  // 11 then the EOS 7; nothing after it
  CHECK((st.output(0) == V{100, 11, 7}));
  CHECK(st.finished(0) && st.reason(0) == FinishReason::eos);
  // A finished request commits nothing more and reports r = 0.
  st.set_draft(draft.data());
  st.step(argmax.data(), 1, r.data(), b.data(), c.data());
  CHECK(c[0] == 0 && r[0] == 0);
  CHECK(st.output(0).size() == 3);
  CHECK(st.slots(0).size() == 1);
}

static void test_max_new_mid_block() {
  RoundState st = started(4, {}, 1000);  // the first token counts: 3 more allowed
  V draft{11, 12, 13, 14}, argmax{11, 12, 13, 14, 15}, r(1), b(1), c(1);
  st.set_draft(draft.data());
  st.step(argmax.data(), 0, r.data(), b.data(), c.data());
  CHECK(c[0] == 3);
  CHECK((st.output(0) == V{100, 11, 12, 13}));
  CHECK(st.reason(0) == FinishReason::length);
  // The bonus alone can hit the limit too.
  RoundState st2 = started(2, {}, 1000);
  V miss{50, 12, 13, 14};
  st2.set_draft(miss.data());
  st2.step(argmax.data(), 0, r.data(), b.data(), c.data());
  CHECK(r[0] == 0 && c[0] == 1 && st2.output(0).back() == 11 && st2.reason(0) == FinishReason::length);
}

static void test_max_len() {
  // prompt 10 + first token: target_pos 10; the next verify needs rows 10..14 < 15 = max_len.
  RoundState st = started(100, {}, 15);
  CHECK(!st.finished(0));
  V draft{11, 12, 13, 14}, argmax{11, 12, 13, 14, 15}, r(1), b(1), c(1);
  st.set_draft(draft.data());
  st.step(argmax.data(), 0, r.data(), b.data(), c.data());
  CHECK(c[0] == 4);  // prompt + output stops at exactly max_len = 15
  CHECK(st.committed_len(0) == 15 && st.reason(0) == FinishReason::max_len);
  RoundState tight(1, 4, 100, {}, 14);  // 10 + d + 1 rows do not fit: stop right after the first token
  V p{10}, first{100}, cc(1);
  tight.start(p.data(), first.data(), cc.data());
  CHECK(tight.reason(0) == FinishReason::max_len && tight.output(0).size() == 1);
}

static void test_ragged_batch() {
  RoundState st(2, 2, 100, {}, 1000);
  V p{5, 9}, first{1, 2}, c(2);
  st.start(p.data(), first.data(), c.data());
  V draft{3, 4, 5, 6}, argmax{3, 4, 8, 0, 0, 0}, r(2), b(2);
  st.set_draft(draft.data());
  st.step(argmax.data(), 2, r.data(), b.data(), c.data());
  CHECK((r == V{2, 0}) && (c == V{3, 1}) && (b == V{8, 0}));
  CHECK(st.target_pos(0) == 8 && st.target_pos(1) == 10);
  CHECK(st.drafter_pos(0) == 8 && st.drafter_pos(1) == 10);
  CHECK(st.committed_len(0) == st.target_pos(0) + 1 && st.committed_len(1) == st.target_pos(1) + 1);
  V bad_r{5, 0};
  st.set_draft(draft.data());
  CHECK_THROWS(st.commit(bad_r.data(), b.data(), 0, c.data()), std::invalid_argument, "r[0] = 5");
}

static void test_round_state_bad_arguments() {
  CHECK_THROWS(RoundState(0, 4, 8, {}, 64), std::invalid_argument, "batch must be >= 1, got 0");
  CHECK_THROWS(RoundState(1, 0, 8, {}, 64), std::invalid_argument, "got 0");
  CHECK_THROWS(RoundState(1, 4, 0, {}, 64), std::invalid_argument, "max_new_tokens must be >= 1, got 0");
  CHECK_THROWS(RoundState(1, 4, 8, {-3}, 64), std::invalid_argument, "got -3");
  RoundState st(1, 4, 8, {}, 64);
  V draft{1, 2, 3, 4};
  CHECK_THROWS(st.set_draft(draft.data()), std::runtime_error, "before start()");
  V p{64}, first{1}, c(1);
  CHECK_THROWS(st.start(p.data(), first.data(), c.data()), std::invalid_argument, "prompt length 64");
  CHECK_THROWS(st.output(1), std::invalid_argument, "request index 1");
}

static void test_tree_meta() {
  const TreeMeta m = tree_meta(2);
  CHECK(m.rows() == 9);
  CHECK((m.query_branch == std::vector<std::int32_t>{-1, -1, -1, 0, 0, 1, 1, 2, 2}));
  CHECK((m.query_pos_offset == std::vector<std::int32_t>{0, 1, 2, 1, 2, 2, 3, 3, 4}));
  CHECK((m.key_spine == std::vector<std::int32_t>{0, 1, 2, -1, -1, -1, -1, -1, -1}));
  // The tree rules (docs/design.md §1) written out directly for every (query, key) pair, d = 1..16.
  for (int d = 1; d <= 16; ++d) {
    const TreeMeta t = tree_meta(d);
    const int rows = t.rows();
    bool same = true;
    for (int q = 0; q < rows; ++q)
      for (int k = 0; k < rows; ++k) {
        bool want;
        if (q <= d) want = k <= q;  // spine row q: causal over the spine
        else {
          const int branch = (q - d - 1) / d;
          want = k <= d ? k <= branch : (k - d - 1) / d == branch;
        }
        same &= t.visible(q, k) == want;
      }
    CHECK(same);
  }
  CHECK_THROWS(tree_meta(0), std::invalid_argument, "got 0");
}

static void test_metrics() {
  Metrics m(3);
  m.add_event(0, "verify", "target", 1000, 5000);
  m.add_event(0, "backbone", "drafter", 2000, 4000);
  m.add_event(1, "we\"ird\n", "target", 6000, 7000);
  const std::string json = m.chrome_trace_json();
  CHECK(json.find("\"traceEvents\"") != std::string::npos);
  CHECK(json.find("{\"name\":\"verify\",\"cat\":\"round\",\"ph\":\"X\",\"pid\":0,\"tid\":1,\"ts\":0.000,\"dur\":4.000,"
                  "\"args\":{\"round\":0}}") != std::string::npos);
  CHECK(json.find("\"ts\":1.000,\"dur\":2.000") != std::string::npos);
  CHECK(json.find("we\\\"ird\\n") != std::string::npos);
  CHECK(json.find("\"thread_name\"") != std::string::npos);
  CHECK_THROWS(m.add_event(2, "verify", "target", 10, 5), std::invalid_argument, "before it starts");
  V r{0, 3, 3, 1};
  m.record_round(r.data(), 4);
  m.record_round(r.data(), 2, true);
  CHECK((m.histogram() == V{2, 1, 0, 3}));
  CHECK(m.rounds() == 2 && m.fallbacks() == 1);
  CHECK(m.tau() > 2.66 && m.tau() < 2.67);  // (2*1 + 1*2 + 3*4) / 6
  auto totals = m.phase_totals();
  CHECK(totals.size() == 3 && totals[0].first == "verify" && totals[0].second == 4000);
  V bad{4};
  CHECK_THROWS(m.record_round(bad.data(), 1), std::invalid_argument, "r[0] = 4");
  m.clear();
  CHECK(m.rounds() == 0 && m.events().empty());
}

static void test_metrics_overlap() {
  // verify spans out of order; drafting that straddles two verifies, touches one at its end, or lies between; a
  // phase that is neither is left out.
  Metrics m(3);
  m.add_event(2, "verify", "target", 40, 50);
  m.add_event(0, "verify", "target", 0, 10);
  m.add_event(1, "verify", "target", 15, 25);
  m.add_event(0, "backbone", "drafter", 5, 20);        // 5 beside the first verify, 5 beside the second
  m.add_event(1, "serial_draft", "drafter", 26, 40);   // between them: exposed
  m.add_event(1, "markov_head", "target", 10, 15);     // not drafting
  const TimelineOverlap o = m.overlap("verify", {"backbone", "serial_draft"});
  CHECK(o.gaps == 2 && o.mean_gap_ns == 10.0);  // (15 - 10 + 40 - 25) / 2
  CHECK(o.drafting_ns == 29 && o.hidden_ns == 10);
  const TimelineOverlap none = Metrics(3).overlap("verify", {"backbone"});
  CHECK(none.gaps == 0 && none.mean_gap_ns == 0.0 && none.drafting_ns == 0 && none.hidden_ns == 0);
}

static void test_draft_limit() {
  // Every object sized by d takes its limit from kMaxDraft: d = kMaxDraft is accepted, one more is refused
  // with the value named.
  const int top = kMaxDraft;
  const std::string too_long = "d must be in 1.." + std::to_string(top) + ", got " + std::to_string(top + 1);
  CHECK(tree_meta(top).rows() == (top + 1) * (top + 1));
  CHECK(Metrics(top).histogram().size() == std::size_t(top + 1));
  CHECK(RoundState(1, top, 8, {}, 256).d() == top);
  CHECK(BoundaryRing(1, 1, top, 1, DType::float32).d() == top);
  CHECK(Staging(1, top, 0).d() == top);
  CHECK_THROWS(tree_meta(top + 1), std::invalid_argument, too_long.c_str());
  CHECK_THROWS(Metrics(top + 1), std::invalid_argument, too_long.c_str());
  CHECK_THROWS(RoundState(1, top + 1, 8, {}, 256), std::invalid_argument, too_long.c_str());
  CHECK_THROWS(BoundaryRing(1, 1, top + 1, 1, DType::float32), std::invalid_argument, too_long.c_str());
  CHECK_THROWS(Staging(1, top + 1, 0), std::invalid_argument, too_long.c_str());
  CHECK_THROWS(Staging(1, 0, 0), std::invalid_argument, "staging draft length d must be in 1..");
}

static void test_accept_round() {
  // One call per round: a greedy round cut by an EOS, then a rule's (r, bonus) with the finished row in the batch.
  RoundState st(2, 3, 100, {7}, 1000);
  Metrics m(3);
  V p{10, 12}, first{100, 200}, c(2), r(2), b(2), keep(2);
  st.start(p.data(), first.data(), c.data());
  V block{100, 11, 7, 13, 200, 21, 22, 23}, argmax{11, 7, 13, 0, 21, 22, 5, 6};
  st.accept(block.data(), 4, argmax.data(), nullptr, nullptr, 1, m, r.data(), b.data(), c.data(), keep.data());
  CHECK((r == V{3, 2}) && (b == V{0, 5}) && (c == V{2, 3}) && (keep == V{4, 3}));
  CHECK((m.histogram() == V{0, 1, 1, 0}));  // row 0 accepted 3 but committed only 11 and the EOS: recorded as 1
  CHECK(st.finished(0) && (st.output(1) == V{200, 21, 22, 5}));
  V block2{0, 0, 0, 0, 5, 31, 32, 33}, rule_r{2, 1}, rule_bonus{9, 40};
  st.accept(block2.data(), 4, nullptr, rule_r.data(), rule_bonus.data(), 0, m, r.data(), b.data(), c.data(),
            keep.data());
  CHECK((r == V{0, 1}) && (b == V{0, 40}) && (c == V{0, 2}) && (keep == V{0, 2}));  // row 0 keeps its s_0
  CHECK((st.output(1) == V{200, 21, 22, 5, 31, 40}) && (m.histogram() == V{0, 2, 1, 0}));
  CHECK_THROWS(st.accept(block2.data(), 4, argmax.data(), rule_r.data(), rule_bonus.data(), 0, m, r.data(), b.data(),
                         c.data(), keep.data()),
               std::invalid_argument, "expected target_argmax (a greedy round) or r and bonus");
  CHECK_THROWS(st.accept(block2.data(), 2, nullptr, rule_r.data(), rule_bonus.data(), 0, m, r.data(), b.data(),
                         c.data(), keep.data()),
               std::invalid_argument, "blocks of T = 2 tokens, expected d + 1 = 4 or 1");
  CHECK(st.rounds() == 2 && m.rounds() == 2);
}

int main() {
  test_greedy_accept();
  test_commit_full_block();
  test_eos_mid_block();
  test_max_new_mid_block();
  test_max_len();
  test_ragged_batch();
  test_round_state_bad_arguments();
  test_tree_meta();
  test_metrics();
  test_metrics_overlap();
  test_draft_limit();
  test_accept_round();
  return check::finish("test_round_metrics");
}
