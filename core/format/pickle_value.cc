#include "core/format/pickle_value.h"

#include <algorithm>
#include <cassert>
#include <cstring>

namespace ucp::pickle {

std::string_view KindName(Kind kind) {
  switch (kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kStr:
      return "str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kByteArray:
      return "bytearray";
    case Kind::kTuple:
      return "tuple";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kSet:
      return "set";
    case Kind::kFrozenSet:
      return "frozenset";
    case Kind::kGlobal:
      return "global";
    case Kind::kObject:
      return "object";
    case Kind::kPersistentId:
      return "persistent_id";
    case Kind::kExtension:
      return "extension";
  }
  return "unknown";
}

namespace {

// Drops the high bytes that sign extension would restore: the minimal two's-complement form.
void TrimTwosComplement(std::string& bytes) {
  while (bytes.size() > 1) {
    const auto top = static_cast<uint8_t>(bytes.back());
    const auto next = static_cast<uint8_t>(bytes[bytes.size() - 2]);
    if ((top == 0x00 && (next & 0x80) == 0) || (top == 0xff && (next & 0x80) != 0)) {
      bytes.pop_back();
    } else {
      break;
    }
  }
  if (bytes.size() == 1 && bytes[0] == 0) bytes.clear();
}

std::string Int64Bytes(int64_t value) {
  std::string bytes(8, '\0');
  auto u = static_cast<uint64_t>(value);
  for (size_t i = 0; i < 8; ++i) bytes[i] = static_cast<char>((u >> (8 * i)) & 0xff);
  TrimTwosComplement(bytes);
  return bytes;
}

bool IsSharable(const Value* v) {
  switch (v->kind()) {
    case Kind::kTuple:
    case Kind::kFrozenSet:
      return !v->items().empty();
    case Kind::kList:
    case Kind::kDict:
    case Kind::kSet:
    case Kind::kByteArray:
    case Kind::kObject:
    case Kind::kPersistentId:
      return true;
    default:
      return false;
  }
}

void AppendEscaped(std::string& out, std::string_view bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += '"';
  for (char c : bytes) {
    const auto u = static_cast<uint8_t>(c);
    if (u >= 0x20 && u < 0x7f && c != '"' && c != '\\') {
      out += c;
    } else {
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 0xf];
    }
  }
  out += '"';
}

// Calls f on each child of v: an object's callable, args, kwargs and mutation operands; a
// persistent id's pid; container elements and dict keys and values.
template <typename F>
void ForEachChild(const Value* v, F&& f) {
  switch (v->kind()) {
    case Kind::kTuple:
    case Kind::kList:
    case Kind::kSet:
    case Kind::kFrozenSet:
      for (Value* item : v->items()) f(item);
      break;
    case Kind::kDict:
      for (const auto& [key, value] : v->entries()) {
        f(key);
        f(value);
      }
      break;
    case Kind::kObject:
      f(v->callable());
      f(v->args());
      if (v->kwargs() != nullptr) f(v->kwargs());
      for (const Mutation& m : v->mutations()) {
        f(m.first);
        if (m.second != nullptr) f(m.second);
      }
      break;
    case Kind::kPersistentId:
      f(v->pid());
      break;
    default:
      break;
  }
}

class Renderer {
 public:
  // Counts how often each node is reached. An object's argument tuple and kwargs dict are
  // rebuilt by the call in Python (`f(*args)`), so only their contents count.
  void CountReferences(const Value* root) {
    std::vector<const Value*> pending = {root};
    refs_[root] = 1;
    while (!pending.empty()) {
      const Value* v = pending.back();
      pending.pop_back();
      const auto visit = [&](const Value* child) {
        if (refs_[child]++ == 0) pending.push_back(child);
      };
      if (v->kind() == Kind::kObject) {
        visit(v->callable());
        for (Value* item : v->args()->items()) visit(item);
        if (v->kwargs() != nullptr) {
          for (const auto& [key, value] : v->kwargs()->entries()) {
            visit(key);
            visit(value);
          }
        }
        for (const Mutation& m : v->mutations()) {
          visit(m.first);
          if (m.second != nullptr) visit(m.second);
        }
      } else {
        ForEachChild(v, [&](const Value* child) { visit(child); });
      }
    }
  }

  Status Render(const Value* v, uint32_t depth, std::string& out) {
    if (depth > kMaxDepth) {
      return Status::OutOfRange("pickle: render: nesting deeper than " + std::to_string(kMaxDepth));
    }
    if (IsSharable(v) && refs_[v] > 1) {
      uint64_t& label = labels_[v];
      const bool first = label == 0;
      if (first) label = ++label_count_;
      out += '#';
      out += std::to_string(label);
      if (!first) return Status::Ok();
      out += '=';
    }
    return RenderBody(v, depth, out);
  }

 private:
  Status RenderItems(const std::vector<Value*>& items, uint32_t depth, std::string& out) {
    for (size_t i = 0; i < items.size(); ++i) {
      if (i > 0) out += ", ";
      UCP_RETURN_IF_ERROR(Render(items[i], depth + 1, out));
    }
    return Status::Ok();
  }

  Status RenderEntries(const std::vector<std::pair<Value*, Value*>>& entries, uint32_t depth,
                       std::string& out) {
    out += '{';
    for (size_t i = 0; i < entries.size(); ++i) {
      if (i > 0) out += ", ";
      UCP_RETURN_IF_ERROR(Render(entries[i].first, depth + 1, out));
      out += ": ";
      UCP_RETURN_IF_ERROR(Render(entries[i].second, depth + 1, out));
    }
    out += '}';
    return Status::Ok();
  }

  Status RenderTuple(const std::vector<Value*>& items, uint32_t depth, std::string& out) {
    out += '(';
    UCP_RETURN_IF_ERROR(RenderItems(items, depth, out));
    if (items.size() == 1) out += ',';
    out += ')';
    return Status::Ok();
  }

  Status RenderBody(const Value* v, uint32_t depth, std::string& out) {
    switch (v->kind()) {
      case Kind::kNone:
        out += "None";
        return Status::Ok();
      case Kind::kBool:
        out += v->bool_value() ? "True" : "False";
        return Status::Ok();
      case Kind::kInt:
        out += v->IntDecimal();
        return Status::Ok();
      case Kind::kFloat: {
        uint64_t bits;
        const double d = v->float_value();
        std::memcpy(&bits, &d, sizeof(bits));
        static constexpr char kHex[] = "0123456789abcdef";
        out += "f:";
        for (int shift = 60; shift >= 0; shift -= 4) out += kHex[(bits >> shift) & 0xf];
        return Status::Ok();
      }
      case Kind::kStr:
        out += 's';
        AppendEscaped(out, v->data());
        return Status::Ok();
      case Kind::kBytes:
        out += 'b';
        AppendEscaped(out, v->data());
        return Status::Ok();
      case Kind::kByteArray:
        out += "ba";
        AppendEscaped(out, v->data());
        return Status::Ok();
      case Kind::kTuple:
        return RenderTuple(v->items(), depth, out);
      case Kind::kList:
        out += '[';
        UCP_RETURN_IF_ERROR(RenderItems(v->items(), depth, out));
        out += ']';
        return Status::Ok();
      case Kind::kDict:
        return RenderEntries(v->entries(), depth, out);
      case Kind::kSet:
      case Kind::kFrozenSet: {
        std::vector<std::string> rendered;
        for (const Value* item : v->items()) {
          std::string s;
          UCP_RETURN_IF_ERROR(Render(item, depth + 1, s));
          rendered.push_back(std::move(s));
        }
        std::sort(rendered.begin(), rendered.end());
        out += v->kind() == Kind::kSet ? "set{" : "frozenset{";
        for (size_t i = 0; i < rendered.size(); ++i) {
          if (i > 0) out += ", ";
          out += rendered[i];
        }
        out += '}';
        return Status::Ok();
      }
      case Kind::kGlobal:
        out += "g:" + v->module() + ":" + v->name();
        return Status::Ok();
      case Kind::kExtension:
        out += "ext:" + std::to_string(v->extension_code());
        return Status::Ok();
      case Kind::kPersistentId:
        out += "pid(";
        UCP_RETURN_IF_ERROR(Render(v->pid(), depth + 1, out));
        out += ')';
        return Status::Ok();
      case Kind::kObject:
        return RenderObject(v, depth, out);
    }
    return Status::Internal("pickle: render: unknown node kind");
  }

  Status RenderObject(const Value* v, uint32_t depth, std::string& out) {
    const auto& args = v->args()->items();
    bool is_new = false;
    switch (v->construction()) {
      case Construction::kReduce:
        break;
      case Construction::kNewObj:
      case Construction::kNewObjEx:
        is_new = true;
        break;
      case Construction::kInst:
      case Construction::kObj:
        is_new = args.empty();
        break;
    }
    out += is_new ? "new(" : "call(";
    UCP_RETURN_IF_ERROR(Render(v->callable(), depth + 1, out));
    out += ", ";
    UCP_RETURN_IF_ERROR(RenderTuple(args, depth + 1, out));
    if (v->kwargs() != nullptr && !v->kwargs()->entries().empty()) {
      out += ", ";
      UCP_RETURN_IF_ERROR(RenderEntries(v->kwargs()->entries(), depth + 1, out));
    }
    out += ')';
    for (const Mutation& m : v->mutations()) {
      switch (m.op) {
        case Mutation::Op::kAppend:
          out += ".append(";
          UCP_RETURN_IF_ERROR(Render(m.first, depth + 1, out));
          break;
        case Mutation::Op::kSetItem:
          out += ".setitem(";
          UCP_RETURN_IF_ERROR(Render(m.first, depth + 1, out));
          out += ", ";
          UCP_RETURN_IF_ERROR(Render(m.second, depth + 1, out));
          break;
        case Mutation::Op::kBuild:
          out += ".build(";
          UCP_RETURN_IF_ERROR(Render(m.first, depth + 1, out));
          break;
      }
      out += ')';
    }
    return Status::Ok();
  }

  NodeMap<uint64_t> refs_;
  NodeMap<uint64_t> labels_;  // 0: not printed yet
  uint64_t label_count_ = 0;
};

}  // namespace

bool Value::bool_value() const {
  assert(kind_ == Kind::kBool);
  return bool_;
}

std::optional<int64_t> Value::AsInt64() const {
  assert(kind_ == Kind::kInt);
  if (int_is_big_) return std::nullopt;
  return int64_;
}

std::string Value::IntBytes() const {
  assert(kind_ == Kind::kInt);
  return int_is_big_ ? data_ : Int64Bytes(int64_);
}

std::string Value::IntDecimal() const {
  assert(kind_ == Kind::kInt);
  if (!int_is_big_) return std::to_string(int64_);
  // Magnitude of the two's-complement bytes, then repeated division by 10^9.
  std::string magnitude = data_;
  const bool negative = (static_cast<uint8_t>(magnitude.back()) & 0x80) != 0;
  if (negative) {
    bool carry = true;
    for (char& c : magnitude) {
      auto u = static_cast<uint8_t>(~static_cast<uint8_t>(c));
      if (carry) {
        ++u;
        carry = u == 0;
      }
      c = static_cast<char>(u);
    }
  }
  std::vector<uint32_t> chunks;  // base 10^9, least significant first
  while (!magnitude.empty()) {
    uint64_t remainder = 0;
    for (size_t i = magnitude.size(); i-- > 0;) {
      const uint64_t cur = (remainder << 8) | static_cast<uint8_t>(magnitude[i]);
      magnitude[i] = static_cast<char>(cur / 1000000000);
      remainder = cur % 1000000000;
    }
    chunks.push_back(static_cast<uint32_t>(remainder));
    while (!magnitude.empty() && magnitude.back() == 0) magnitude.pop_back();
  }
  std::string out = negative ? "-" : "";
  out += std::to_string(chunks.back());
  for (size_t i = chunks.size() - 1; i-- > 0;) {
    std::string part = std::to_string(chunks[i]);
    out.append(9 - part.size(), '0');
    out += part;
  }
  return out;
}

double Value::float_value() const {
  assert(kind_ == Kind::kFloat);
  return float_;
}

const std::string& Value::data() const {
  assert(kind_ == Kind::kStr || kind_ == Kind::kBytes || kind_ == Kind::kByteArray);
  return data_;
}

std::string& Value::mutable_data() {
  assert(kind_ == Kind::kStr || kind_ == Kind::kBytes || kind_ == Kind::kByteArray);
  return data_;
}

const std::vector<Value*>& Value::items() const {
  assert(kind_ == Kind::kTuple || kind_ == Kind::kList || kind_ == Kind::kSet ||
         kind_ == Kind::kFrozenSet);
  return items_;
}

std::vector<Value*>& Value::mutable_items() {
  assert(kind_ == Kind::kTuple || kind_ == Kind::kList || kind_ == Kind::kSet ||
         kind_ == Kind::kFrozenSet);
  return items_;
}

Value* Value::Item(size_t i) const {
  if ((kind_ != Kind::kTuple && kind_ != Kind::kList) || i >= items_.size()) return nullptr;
  return items_[i];
}

const std::vector<std::pair<Value*, Value*>>& Value::entries() const {
  assert(kind_ == Kind::kDict);
  return entries_;
}

std::vector<std::pair<Value*, Value*>>& Value::mutable_entries() {
  assert(kind_ == Kind::kDict);
  return entries_;
}

Value* Value::Get(std::string_view key) const {
  const auto is_key = [key](const Value* k) { return k->kind_ == Kind::kStr && k->data_ == key; };
  if (kind_ == Kind::kDict) {
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
      if (is_key(it->first)) return it->second;
    }
  } else if (kind_ == Kind::kObject) {
    for (auto it = mutations_.rbegin(); it != mutations_.rend(); ++it) {
      if (it->op == Mutation::Op::kSetItem && is_key(it->first)) return it->second;
    }
  }
  return nullptr;
}

const std::string& Value::module() const {
  assert(kind_ == Kind::kGlobal);
  return data_;
}

const std::string& Value::name() const {
  assert(kind_ == Kind::kGlobal);
  return name_;
}

bool Value::IsGlobal(std::string_view module, std::string_view name) const {
  return kind_ == Kind::kGlobal && data_ == module && name_ == name;
}

Construction Value::construction() const {
  assert(kind_ == Kind::kObject);
  return construction_;
}

Value* Value::callable() const {
  assert(kind_ == Kind::kObject);
  return callable_;
}

Value* Value::args() const {
  assert(kind_ == Kind::kObject);
  return args_;
}

Value* Value::kwargs() const {
  assert(kind_ == Kind::kObject);
  return kwargs_;
}

void Value::set_callable(Value* callable) {
  assert(kind_ == Kind::kObject && callable != nullptr);
  callable_ = callable;
}

void Value::set_args(Value* args) {
  assert(kind_ == Kind::kObject && args != nullptr && args->kind_ == Kind::kTuple);
  args_ = args;
}

const std::vector<Mutation>& Value::mutations() const {
  assert(kind_ == Kind::kObject);
  return mutations_;
}

std::vector<Mutation>& Value::mutable_mutations() {
  assert(kind_ == Kind::kObject);
  return mutations_;
}

Value* Value::State() const {
  if (kind_ != Kind::kObject) return nullptr;
  for (auto it = mutations_.rbegin(); it != mutations_.rend(); ++it) {
    if (it->op == Mutation::Op::kBuild) return it->first;
  }
  return nullptr;
}

bool Value::IsCallOf(std::string_view module, std::string_view name) const {
  return kind_ == Kind::kObject && callable_->IsGlobal(module, name);
}

Value* Value::pid() const {
  assert(kind_ == Kind::kPersistentId);
  return callable_;
}

void Value::set_pid(Value* pid) {
  assert(kind_ == Kind::kPersistentId && pid != nullptr);
  callable_ = pid;
}

int32_t Value::extension_code() const {
  assert(kind_ == Kind::kExtension);
  return static_cast<int32_t>(int64_);
}

Value* Graph::Add(Kind kind) {
  Value& v = nodes_.emplace_back(Value::Key(), kind);
  v.id_ = nodes_.size() - 1;
  return &v;
}

Value* Graph::None() { return Add(Kind::kNone); }

Value* Graph::Bool(bool value) {
  Value* v = Add(Kind::kBool);
  v->bool_ = value;
  return v;
}

Value* Graph::Int(int64_t value) {
  Value* v = Add(Kind::kInt);
  v->int64_ = value;
  return v;
}

Value* Graph::IntFromBytes(std::string_view twos_complement_le) {
  std::string bytes(twos_complement_le);
  TrimTwosComplement(bytes);
  if (bytes.size() <= 8) {
    uint64_t u = 0;
    for (size_t i = 0; i < bytes.size(); ++i) {
      u |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
    }
    if (!bytes.empty() && bytes.size() < 8 && (static_cast<uint8_t>(bytes.back()) & 0x80) != 0) {
      u |= ~uint64_t{0} << (8 * bytes.size());
    }
    return Int(static_cast<int64_t>(u));
  }
  Value* v = Add(Kind::kInt);
  v->int_is_big_ = true;
  v->data_ = std::move(bytes);
  return v;
}

Value* Graph::Float(double value) {
  Value* v = Add(Kind::kFloat);
  v->float_ = value;
  return v;
}

Value* Graph::Str(std::string utf8) {
  Value* v = Add(Kind::kStr);
  v->data_ = std::move(utf8);
  return v;
}

Value* Graph::Bytes(std::string bytes) {
  Value* v = Add(Kind::kBytes);
  v->data_ = std::move(bytes);
  return v;
}

Value* Graph::ByteArray(std::string bytes) {
  Value* v = Add(Kind::kByteArray);
  v->data_ = std::move(bytes);
  return v;
}

Value* Graph::Tuple(std::vector<Value*> items) {
  Value* v = Add(Kind::kTuple);
  v->items_ = std::move(items);
  return v;
}

Value* Graph::List(std::vector<Value*> items) {
  Value* v = Add(Kind::kList);
  v->items_ = std::move(items);
  return v;
}

Value* Graph::Dict(std::vector<std::pair<Value*, Value*>> entries) {
  Value* v = Add(Kind::kDict);
  v->entries_ = std::move(entries);
  return v;
}

Value* Graph::Set(std::vector<Value*> items) {
  Value* v = Add(Kind::kSet);
  v->items_ = std::move(items);
  return v;
}

Value* Graph::FrozenSet(std::vector<Value*> items) {
  Value* v = Add(Kind::kFrozenSet);
  v->items_ = std::move(items);
  return v;
}

Value* Graph::Global(std::string module, std::string name) {
  Value* v = Add(Kind::kGlobal);
  v->data_ = std::move(module);
  v->name_ = std::move(name);
  return v;
}

Value* Graph::Object(Construction construction, Value* callable, Value* args, Value* kwargs) {
  assert(callable != nullptr && args != nullptr && args->kind() == Kind::kTuple);
  assert((construction == Construction::kNewObjEx) == (kwargs != nullptr));
  Value* v = Add(Kind::kObject);
  v->construction_ = construction;
  v->callable_ = callable;
  v->args_ = args;
  v->kwargs_ = kwargs;
  return v;
}

Value* Graph::PersistentId(Value* pid) {
  assert(pid != nullptr);
  Value* v = Add(Kind::kPersistentId);
  v->callable_ = pid;
  return v;
}

Value* Graph::Extension(int32_t code) {
  Value* v = Add(Kind::kExtension);
  v->int64_ = code;
  return v;
}

namespace {

// Calls visit(node) once per node reachable from root, root first, without recursion; stops
// at the first non-OK Status.
template <typename Visit>
Status Walk(const Value* root, Visit&& visit) {
  std::vector<const Value*> pending = {root};
  NodeMap<uint8_t> seen;
  seen[root] = 1;
  std::vector<const Value*> children;
  while (!pending.empty()) {
    const Value* v = pending.back();
    pending.pop_back();
    UCP_RETURN_IF_ERROR(visit(v));
    // Pushed in reverse so that children are visited in child order.
    children.clear();
    ForEachChild(v, [&](const Value* child) { children.push_back(child); });
    for (auto it = children.rbegin(); it != children.rend(); ++it) {
      uint8_t& mark = seen[*it];
      if (mark == 0) {
        mark = 1;
        pending.push_back(*it);
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Value* Graph::Import(const Value* root) {
  NodeMap<Value*> copies(nullptr);
  std::vector<const Value*> originals;
  (void)Walk(root, [&](const Value* v) {
    Value* copy = Add(v->kind_);
    copy->construction_ = v->construction_;
    copy->bool_ = v->bool_;
    copy->int_is_big_ = v->int_is_big_;
    copy->int64_ = v->int64_;
    copy->float_ = v->float_;
    copy->data_ = v->data_;
    copy->name_ = v->name_;
    copies[v] = copy;
    originals.push_back(v);
    return Status::Ok();
  });
  const auto map = [&](const Value* v) { return v == nullptr ? nullptr : copies[v]; };
  for (const Value* v : originals) {
    Value* copy = copies[v];
    for (const Value* item : v->items_) copy->items_.push_back(map(item));
    for (const auto& [key, value] : v->entries_) copy->entries_.emplace_back(map(key), map(value));
    copy->callable_ = map(v->callable_);
    copy->args_ = map(v->args_);
    copy->kwargs_ = map(v->kwargs_);
    for (const Mutation& m : v->mutations_) {
      copy->mutations_.push_back({m.op, map(m.first), map(m.second)});
    }
  }
  return copies[root];
}

Status ForEachReachable(Value* root, const std::function<Status(Value*)>& visit) {
  // Graph owns its nodes as mutable; the walk itself only reads them.
  return Walk(root, [&](const Value* v) { return visit(const_cast<Value*>(v)); });
}

Result<std::string> Render(const Value* root) {
  Renderer renderer;
  renderer.CountReferences(root);
  std::string out;
  UCP_RETURN_IF_ERROR(renderer.Render(root, 0, out));
  return out;
}

}  // namespace ucp::pickle
