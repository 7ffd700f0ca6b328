#pragma once
// Round metrics: a timeline of phases per round (exported as Chrome / Perfetto trace JSON), the
// acceptance-length histogram and the fallback counter. Thread-safe: lanes may add events concurrently.
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "dpara_rt/types.h"

namespace dpara_rt {

struct TimelineEvent {
  std::int64_t round;
  std::string phase;  // verify, backbone, markov_head, transfer, exposed_draft, or any other name
  std::string lane;   // the trace row
  std::int64_t start_ns, end_ns;  // now_ns() clock
};

// How a timeline's drafting sat against its verifications (Metrics::overlap).
struct TimelineOverlap {
  std::int64_t gaps = 0;        // consecutive verify spans (verifies - 1, or 0)
  double mean_gap_ns = 0;       // mean time from one verify's end to the next one's start
  std::int64_t drafting_ns = 0;  // total time of the drafting phases' spans
  std::int64_t hidden_ns = 0;    // the part of it that overlaps a verify span
};

class Metrics {
 public:
  explicit Metrics(int d);  // histogram bins 0..d; std::invalid_argument unless 1 <= d <= kMaxDraft

  // std::invalid_argument when end_ns < start_ns.
  void add_event(std::int64_t round, std::string phase, std::string lane, std::int64_t start_ns, std::int64_t end_ns);
  // One round of a batch: the acceptance length r[b] (0..d) of each running request; `fallback`: the round's
  // drafting guess missed (PSD) and the drafter had to run serially.
  void record_round(const std::int64_t* r, std::int64_t n, bool fallback = false);
  // A fallback found after its round was recorded (PSD learns of a miss only when the next round drafts).
  void record_fallback();
  void clear();

  int d() const { return d_; }
  std::vector<std::int64_t> histogram() const;  // [d+1]: how often r took each value
  std::int64_t rounds() const;
  std::int64_t fallbacks() const;
  // Mean committed tokens per request-round, bonus included (tau = mean(r) + 1); 0 before any round.
  double tau() const;
  std::vector<TimelineEvent> events() const;
  // The spans of phase `verify` in start order (disjoint: one target lane) and of the `drafting` phases: the
  // exposed time between verifications and how much drafting ran beside one, without copying the timeline out.
  TimelineOverlap overlap(const std::string& verify, const std::vector<std::string>& drafting) const;
  // Total nanoseconds per phase name, in order of first appearance.
  std::vector<std::pair<std::string, std::int64_t>> phase_totals() const;
  // {"traceEvents": [...], "displayTimeUnit": "ms"}: one complete ("X") event per timeline event, one
  // thread row per lane (named by metadata events), timestamps in microseconds from the earliest event.
  std::string chrome_trace_json() const;

 private:
  int d_;
  mutable std::mutex mu_;
  std::vector<TimelineEvent> events_;
  std::vector<std::int64_t> hist_;
  std::int64_t rounds_ = 0, fallbacks_ = 0;
};

}  // namespace dpara_rt
