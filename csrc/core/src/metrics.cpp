#include "dpara_rt/metrics.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "util.h"

namespace dpara_rt {

namespace {

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += char(c);
        }
    }
  }
  out += '"';
}

std::string micros(std::int64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", double(ns) / 1e3);
  return buf;
}

}  // namespace

Metrics::Metrics(int d) : d_(d) {
  detail::check_draft_length(d, "metrics");
  hist_.assign(std::size_t(d + 1), 0);
}

void Metrics::add_event(std::int64_t round, std::string phase, std::string lane, std::int64_t start_ns,
                        std::int64_t end_ns) {
  if (end_ns < start_ns)
    detail::value_error("timeline event '", phase, "' of round ", round, " ends at ", end_ns, " ns before it starts at ",
                        start_ns, " ns");
  std::lock_guard<std::mutex> lk(mu_);
  events_.push_back({round, std::move(phase), std::move(lane), start_ns, end_ns});
}

void Metrics::record_round(const std::int64_t* r, std::int64_t n, bool fallback) {
  for (std::int64_t b = 0; b < n; ++b)
    if (r[b] < 0 || r[b] > d_)
      detail::value_error("acceptance length r[", b, "] = ", r[b], " out of range: expected 0..", d_);
  std::lock_guard<std::mutex> lk(mu_);
  for (std::int64_t b = 0; b < n; ++b) ++hist_[std::size_t(r[b])];
  ++rounds_;
  if (fallback) ++fallbacks_;
}

void Metrics::clear() {
  std::lock_guard<std::mutex> lk(mu_);
  events_.clear();
  std::fill(hist_.begin(), hist_.end(), 0);
  rounds_ = fallbacks_ = 0;
}

std::vector<std::int64_t> Metrics::histogram() const {
  std::lock_guard<std::mutex> lk(mu_);
  return hist_;
}

std::int64_t Metrics::rounds() const {
  std::lock_guard<std::mutex> lk(mu_);
  return rounds_;
}

void Metrics::record_fallback() {
  std::lock_guard<std::mutex> lk(mu_);
  ++fallbacks_;
}

std::int64_t Metrics::fallbacks() const {
  std::lock_guard<std::mutex> lk(mu_);
  return fallbacks_;
}

double Metrics::tau() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::int64_t count = 0, sum = 0;
  for (std::size_t r = 0; r < hist_.size(); ++r) {
    count += hist_[r];
    sum += hist_[r] * std::int64_t(r + 1);
  }
  return count ? double(sum) / double(count) : 0.0;
}

std::vector<TimelineEvent> Metrics::events() const {
  std::lock_guard<std::mutex> lk(mu_);
  return events_;
}

TimelineOverlap Metrics::overlap(const std::string& verify, const std::vector<std::string>& drafting) const {
  using Span = std::pair<std::int64_t, std::int64_t>;
  std::vector<Span> verifies, drafts;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& e : events_) {
      if (e.phase == verify) verifies.emplace_back(e.start_ns, e.end_ns);
      else if (std::find(drafting.begin(), drafting.end(), e.phase) != drafting.end())
        drafts.emplace_back(e.start_ns, e.end_ns);
    }
  }
  std::sort(verifies.begin(), verifies.end());
  std::sort(drafts.begin(), drafts.end());
  TimelineOverlap out;
  double gap_sum = 0;
  for (std::size_t i = 1; i < verifies.size(); ++i) gap_sum += double(verifies[i].first - verifies[i - 1].second);
  out.gaps = verifies.empty() ? 0 : std::int64_t(verifies.size()) - 1;
  out.mean_gap_ns = out.gaps ? gap_sum / double(out.gaps) : 0.0;
  std::size_t first = 0;  // the first verify that ends after the current drafting span starts
  for (const auto& [s, e] : drafts) {
    out.drafting_ns += e - s;
    while (first < verifies.size() && verifies[first].second <= s) ++first;
    for (std::size_t j = first; j < verifies.size() && verifies[j].first < e; ++j)
      out.hidden_ns += std::max<std::int64_t>(0, std::min(e, verifies[j].second) - std::max(s, verifies[j].first));
  }
  return out;
}

std::vector<std::pair<std::string, std::int64_t>> Metrics::phase_totals() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::pair<std::string, std::int64_t>> totals;
  for (const auto& e : events_) {
    auto it = std::find_if(totals.begin(), totals.end(), [&](const auto& t) { return t.first == e.phase; });
    if (it == totals.end()) totals.emplace_back(e.phase, e.end_ns - e.start_ns);
    else it->second += e.end_ns - e.start_ns;
  }
  return totals;
}

std::string Metrics::chrome_trace_json() const {
  const auto evs = events();
  std::int64_t t0 = 0;
  if (!evs.empty())
    t0 = std::min_element(evs.begin(), evs.end(), [](auto& a, auto& b) { return a.start_ns < b.start_ns; })->start_ns;
  std::map<std::string, int> tids;  // lane -> trace thread id, in order of first appearance
  for (const auto& e : evs) tids.emplace(e.lane, int(tids.size()) + 1);
  std::string out = "{\"traceEvents\":[";
  bool first = true;
  auto sep = [&] {
    if (!first) out += ',';
    first = false;
  };
  for (const auto& [lane, tid] : tids) {
    sep();
    out += "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" + std::to_string(tid) + ",\"args\":{\"name\":";
    json_string(out, lane);
    out += "}}";
  }
  for (const auto& e : evs) {
    sep();
    out += "{\"name\":";
    json_string(out, e.phase);
    out += ",\"cat\":\"round\",\"ph\":\"X\",\"pid\":0,\"tid\":" + std::to_string(tids[e.lane]) +
           ",\"ts\":" + micros(e.start_ns - t0) + ",\"dur\":" + micros(e.end_ns - e.start_ns) +
           ",\"args\":{\"round\":" + std::to_string(e.round) + "}}";
  }
  out += "],\"displayTimeUnit\":\"ms\"}";
  return out;
}

}  // namespace dpara_rt
